"""`twobp train` end to end on every model family: the run exits 0 and its loss falls.

Each run trains the tiny size of one family (``--model`` or a Hugging Face
``--hf-config``) for a few steps on 2 ranks with 2BP, logging every step to
OUT/metrics.jsonl; the last logged loss must lie well below the first.
"""

from __future__ import annotations

import pytest

from twobp.cli.main import main
from twobp.train.metrics import read_records

SMALL = [
    "--size", "tiny", "--microbatches", "2", "--warmup", "1", "--two-bp", "--threads", "1",
    "--timeout", "60", "--no-save", "--log-every", "1",
]  # fmt: skip
TEXT = ["--steps", "8", "--batch-size", "4", "--seq-len", "16", "--lr", "1e-2"]
# ResNet's BatchNorm wants more than 2 images a micro-batch, and a gentler rate.
IMAGES = ["--steps", "10", "--batch-size", "16", "--lr", "3e-3"]


def _train(tmp_path, options: list[str]) -> list[float]:
    """The losses OUT/metrics.jsonl logs of a run with ``options``; it must exit 0."""
    out = tmp_path / "run"
    assert main(["train", *SMALL, *options, "--out", str(out)]) == 0
    records = read_records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


@pytest.mark.parametrize(
    ("model", "options", "fall"),
    [("bert", TEXT, 1.0), ("mamba", TEXT, 1.0), ("resnet", IMAGES, 0.5)],
)
def test_a_model_trains_and_its_loss_falls(tmp_path, model, options, fall):
    losses = _train(tmp_path, ["--model", model, *options])
    assert len(losses) == int(options[1])
    assert losses[-1] < losses[0] - fall, losses


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", ["gpt2", "bert", "mamba"])
def test_a_hugging_face_model_trains_and_its_loss_falls(tmp_path, family):
    pytest.importorskip("transformers")
    losses = _train(tmp_path, ["--hf-config", family, *TEXT])
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 1.0, losses
