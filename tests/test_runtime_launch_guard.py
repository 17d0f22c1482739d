"""A script that calls twobp.launch without `if __name__ == "__main__":` gets one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import twobp

def work():
    return 1

print(twobp.launch(work, 2, timeout=120))
"""


def test_an_unguarded_launch_says_so_in_one_line(tmp_path: Path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("twobp.runtime.errors.LaunchError: twobp.launch needs an `if __name__")
    # The caller's traceback only: no rank prints multiprocessing's.
    assert "bootstrapping phase" not in done.stderr
    assert len(done.stderr.strip().splitlines()) < 12, done.stderr
