"""The examples' functions, picklable for launch: each child loads the example script itself."""

from __future__ import annotations

from typing import Any

from repo_scripts import load_script


def train_encoder_decoder(*args: Any) -> Any:
    return load_script("examples/encoder_decoder.py").train(*args)
