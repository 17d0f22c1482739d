"""Whose checkpoints an ``--out`` folder holds, and which of them a run may replace.

``OUT/checkpoints`` belongs to one run: a fresh run starts it, and a run that
continues the latest checkpoint there (``--resume OUT``, ``--resume auto``)
is the same run going on. Checkpoint rotation (``--keep-checkpoints``, see
:func:`twobp.runtime.state.checkpoint.files.prune`) deletes older and later
checkpoints of the folder, so before any rank starts a run is refused when
the folder holds checkpoints it does not continue:

- a run without ``--resume`` into a folder with checkpoints;
- ``--resume`` from a checkpoint of another folder into a folder with checkpoints;
- ``--resume`` from a checkpoint of the folder that is not its latest: the later
  (intact) ones would be replaced.

``--resume auto`` is never refused: it continues the folder's run, passing over
damaged checkpoints if need be.

``--overwrite`` lets such a run go on: when it starts, the checkpoints it does
not continue are deleted (all of them, or, resuming inside the folder, those
after the one it resumes from). Either way every checkpoint rotation may later
delete was written by this run or by the run it continues.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
from pathlib import Path

from twobp.runtime.base.group import LAUNCHER_VARIABLES
from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint import integrity
from twobp.runtime.state.checkpoint.files import complete_checkpoints, step_of
from twobp.train.checkpointing import checkpoint_root, resume_source
from twobp.train.config import TrainConfig


def foreign_checkpoints(cfg: TrainConfig) -> list[Path]:
    """The checkpoints of ``OUT/checkpoints`` that this run does not continue, oldest first.

    ``--resume auto`` continues the folder's run whatever it holds (it may
    pass over damaged checkpoints to an earlier one). Resuming a checkpoint of
    the folder by name, damaged later ones do not count: the run cannot
    continue from them, and rotation may delete them.

    Raises:
        CheckpointError: if ``--resume`` names no complete checkpoint.
    """
    if cfg.resume == "auto":
        return []
    found = complete_checkpoints(checkpoint_root(cfg))[::-1]
    source = _resumed_inside(cfg)
    if source is None:
        return found
    reached = step_of(source)
    if reached is None:
        return []
    return [c for c in found if (step_of(c) or 0) > reached and integrity.is_intact(c)]


def check_out_folder(cfg: TrainConfig) -> None:
    """Refuse a run whose checkpoints would replace those of another run in ``--out``.

    Raises:
        ValueError: naming the folder, the checkpoints and the three ways on,
            unless ``--overwrite`` is given.
    """
    if cfg.overwrite:
        return
    try:
        foreign = foreign_checkpoints(cfg)
    except CheckpointError:
        return  # check_resume names what is wrong with --resume
    if not foreign:
        return
    root = checkpoint_root(cfg)
    steps = _steps_text(foreign)
    if _resumed_inside(cfg) is not None:
        raise ValueError(
            f"--resume {cfg.resume}: {root} holds later checkpoints ({steps}) that this run "
            f"would replace; resume from the latest with --resume {cfg.out}, replace them "
            "with --overwrite, or give another --out"
        )
    raise ValueError(
        f"--out {cfg.out} holds checkpoints of another run ({steps}, in {root}); continue it "
        f"with --resume {cfg.out}, replace them with --overwrite, or give another --out"
    )


def delete_foreign_checkpoints(cfg: TrainConfig) -> list[Path]:
    """With ``--overwrite``, delete the checkpoints of ``OUT`` that this run does not continue.

    Returns:
        The deleted checkpoints (none without ``--overwrite``).
    """
    if not cfg.overwrite:
        return []
    foreign = foreign_checkpoints(cfg)
    for path in foreign:
        shutil.rmtree(path)
    return foreign


def _resumed_inside(cfg: TrainConfig) -> Path | None:
    """The checkpoint this run resumes from if it lies in ``OUT/checkpoints``, else None."""
    source = resume_source(cfg)
    if source is None or source.resolve().parent != checkpoint_root(cfg).resolve():
        return None
    return source


def _steps_text(checkpoints: list[Path]) -> str:
    steps = sorted({step_of(path) or 0 for path in checkpoints})
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"{len(checkpoints)} checkpoints, steps {steps[0]} to {steps[-1]}"


DEFAULT_OUT = "runs/latest"
"""``--out``'s default: a link to the newest run's own folder under ``runs/``."""


def with_run_folder(cfg: TrainConfig, now: datetime.datetime | None = None) -> TrainConfig:
    """``cfg`` with a folder of its own for a fresh run left at the default ``--out``.

    The default ``runs/latest`` becomes a link to ``runs/<date>-<time>``, made now, so
    that running the main job again never meets an earlier run's checkpoints and never
    deletes them. Unchanged: another ``--out``; a run that resumes (``runs/latest``
    leads to the run it continues); a ``runs/latest`` that is a folder of its own (an
    older layout: it is left as it was); and a rank of ``torchrun``, whose ranks must
    agree on one folder (give ``--out``).
    """
    latest = Path(DEFAULT_OUT)
    if (
        cfg.out != DEFAULT_OUT
        or cfg.resume is not None
        or any(v in os.environ for v in LAUNCHER_VARIABLES)
        or (latest.exists() and not latest.is_symlink())
    ):
        return cfg
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    folder, n = latest.parent / stamp, 1
    while folder.exists() or folder.is_symlink():
        n += 1
        folder = latest.parent / f"{stamp}-{n}"
    folder.mkdir(parents=True)
    # Replaced at once: the link never leads nowhere.
    fresh = latest.parent / f".latest-{os.getpid()}"
    fresh.unlink(missing_ok=True)
    fresh.symlink_to(folder.name)
    os.replace(fresh, latest)
    return dataclasses.replace(cfg, out=str(folder))
