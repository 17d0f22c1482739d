"""``twobp train`` with a rank that dies once, for ``torchrun --max-restarts``.

Run as ``torchrun ... tests/reliability_train_script.py <twobp train options>
--kill-at STEP``. In the first attempt of the group (``TORCHELASTIC_RESTART_COUNT``
is 0), rank 1 kills itself with SIGKILL before step ``STEP``; torchrun then
restarts the group, and ``--resume auto`` continues from the last checkpoint.
With ``HOLD_WRITE_AT=STEP`` in the environment, rank 1's write of step ``STEP``'s
checkpoint never ends in the first attempt: the kill comes while it is written.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import torch.distributed as dist

from twobp.cli.main import build_parser
from twobp.config import from_namespace
from twobp.train.config import TrainConfig
from twobp.train.run import run_training


def kill_once(rank: int, step: int) -> None:
    """SIGKILL rank 1 before step ``KILL_AT`` of the first attempt."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if rank == 1 and step == int(os.environ["KILL_AT"]) and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)


def hold_write_once(step: int) -> None:
    """On rank 1 of the first attempt, the data write of step ``step``'s checkpoint (in
    the background) waits until the process is killed."""
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def held(self: Any, plan: Any, planner: Any) -> Any:
        if f"step-{step:08d}" in str(self.path):
            threading.Event().wait()
        return write(self, plan, planner)

    FileSystemWriter.write_data = held  # type: ignore[method-assign]


if __name__ == "__main__":
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if "HOLD_WRITE_AT" in os.environ and first_attempt and os.environ.get("RANK") == "1":
        hold_write_once(int(os.environ["HOLD_WRITE_AT"]))
    args = build_parser().parse_args(["train", *sys.argv[1:]])
    run_training(from_namespace(TrainConfig, args), on_step=kill_once)
    dist.destroy_process_group()
