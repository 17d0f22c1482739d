"""Checkpoints of ``twobp train``: where they go, when, and how a run resumes.

A run saves into ``OUT/checkpoints`` every ``--save-every`` steps and at its
end. A checkpoint holds, besides the pipeline's weights, optimizer and RNG
states and the loss scale, the run's history (the step reached, the loss of
every step, the skipped steps) and, in its manifest, the run's options. Data batches are a
pure function of ``(seed, step)``, so the step is the data position: a
resumed run sees the batches an uninterrupted run would have seen, and ends
with the same weights (bitwise on the CPU).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from twobp.runtime import Pipeline
from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint import find_checkpoint, integrity, read_manifest
from twobp.runtime.state.checkpoint.files import complete_checkpoints
from twobp.train.config import TrainConfig

SAME_MODEL_OPTIONS = (
    "model",
    "hf_config",
    "size",
    "seq_len",
    "min_seq_len",
    "dtype",
    "autocast",
    "seed",
    "data",
)
"""Options a resumed run must share with the run it continues: they define the model and data
(``--hf-config`` replaces ``--model``, ``--autocast`` sets the parameters' dtype). A checkpoint
that predates an option ran with its default."""

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


@dataclass
class History:
    """What a run carries over a resume (saved as the checkpoint's ``extra``)."""

    step: int = 0
    """Steps done: the next step to run, and the data position."""
    losses: list[float] = field(default_factory=list)
    """The mean loss of every step done."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps whose loss was not finite and whose gradients were dropped."""
    overflow_steps: list[int] = field(default_factory=list)
    """Steps skipped by the loss scaler: some gradient overflowed float16 (``--loss-scale``)."""


def checkpoint_root(cfg: TrainConfig) -> Path:
    """The folder of this run's checkpoints."""
    return Path(cfg.out) / "checkpoints"


def last_step(cfg: TrainConfig) -> int:
    """The step this run ends at (``--stop-after`` or ``--steps``)."""
    return cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)


def resume_source(cfg: TrainConfig) -> Path | None:
    """The checkpoint this run continues from, or None for a fresh start.

    ``--resume auto`` takes the newest checkpoint of ``--out`` whose files
    have their sizes (see :func:`.integrity.is_intact`).

    Raises:
        CheckpointError: if ``--resume`` names no complete checkpoint.
    """
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        found = _intact_checkpoints(cfg)
        return found[0] if found else None
    return find_checkpoint(cfg.resume)


def _intact_checkpoints(cfg: TrainConfig) -> list[Path]:
    return [c for c in complete_checkpoints(checkpoint_root(cfg)) if integrity.is_intact(c)]


def check_resume(cfg: TrainConfig) -> None:
    """Refuse a resume that cannot continue the run, before any rank starts.

    Reads the whole checkpoint once, to check its files' sizes and CRC-32s.
    ``--resume auto`` passes over damaged checkpoints to the newest intact
    one, with a warning on stderr; a named checkpoint that is damaged is refused.

    Raises:
        ValueError: if the checkpoint is missing or damaged (naming the file
            and the previous intact checkpoint), comes from another model or
            data, or already reached the step this run would end at.
    """
    try:
        source, manifest = _checked_source(cfg)
        if source is None:
            return
    except CheckpointError as exc:
        raise ValueError(f"--resume {cfg.resume}: {exc}") from None
    saved = manifest.get("meta", {}).get("config")
    if saved is None:
        raise ValueError(
            f"--resume {cfg.resume}: {source} was not written by twobp train (no options in "
            "its manifest); load it from Python with Pipeline.load"
        )
    differ = [
        f"--{name.replace('_', '-')} {saved.get(name, _DEFAULTS[name])} "
        f"(this run: {getattr(cfg, name)})"
        for name in SAME_MODEL_OPTIONS
        if saved.get(name, _DEFAULTS[name]) != getattr(cfg, name)
    ]
    if differ:
        raise ValueError(
            f"--resume {cfg.resume}: {source} was trained with {', '.join(differ)}; pass the "
            "same model and data options, or start a new run without --resume"
        )
    if manifest["step"] >= last_step(cfg):
        raise ValueError(
            f"--resume {cfg.resume}: {source} is at step {manifest['step']} already, and this "
            f"run would end at step {last_step(cfg)}; raise --steps (or --stop-after) to train on"
        )


def _checked_source(cfg: TrainConfig) -> tuple[Path | None, dict[str, Any]]:
    """The checkpoint to resume from and its manifest, its files checked in full."""
    if cfg.resume != "auto":
        source = resume_source(cfg)
        return source, ({} if source is None else integrity.check(source))
    found = complete_checkpoints(checkpoint_root(cfg))
    problems = []
    for source in found:
        try:
            manifest = read_manifest(source)
            damaged = integrity.damage(source, manifest)
        except CheckpointError as exc:
            damaged = [str(exc)]
        if damaged:
            problems.append(damaged[0])
            continue
        for problem in problems:
            print(f"warning: --resume auto: {problem}; resuming from {source}", file=sys.stderr)
        return source, manifest
    if problems:
        raise CheckpointError(
            f"no checkpoint in {checkpoint_root(cfg)} is intact ({problems[0]}); resume from "
            "another folder, or move these checkpoints away to start afresh"
        )
    return None, {}


def resume(pipe: Pipeline, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> History:
    """Load the checkpoint ``--resume`` names into ``pipe`` and ``optimizer``. Collective.

    Under ``--resume auto``, a checkpoint that fails to load (a file changed
    since it was saved: the sizes were checked before, the CRC-32s only now)
    gives way to the next older intact one, with a warning; every rank sees the
    same failure, so all take the same one.

    Returns:
        The history of the run so far (empty for a fresh start).
    """
    if cfg.resume is None:
        return History()
    if cfg.resume != "auto":
        return History(**pipe.load(find_checkpoint(cfg.resume), optimizer))
    found = _intact_checkpoints(cfg)
    for i, source in enumerate(found):
        try:
            return History(**pipe.load(source, optimizer))
        except CheckpointError as exc:
            if i + 1 == len(found):
                raise
            if pipe.rank == 0:
                print(
                    f"warning: --resume auto: {exc}; resuming from {found[i + 1]}", file=sys.stderr
                )
    return History()


def split_layout(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """The options that make the stages a profile chose 2BP on: the same stages again."""
    return {
        "world_size": world_size,
        "schedule": cfg.schedule,
        "stages_per_rank": cfg.stages_per_rank,
        "partition": cfg.partition,
        "data_parallel": cfg.data_parallel,
    }


def resumed_split(cfg: TrainConfig, world_size: int) -> list[bool] | None:
    """With the default ``two_bp``, the stages the resumed run split its backward on.

    A run with ``two_bp`` unset profiles its blocks and splits the stages where
    2BP pays (``Pipeline.two_bp_choice``); its checkpoints record that choice.
    A resume on the same stages (the same ranks, schedule, stages per rank,
    partition and copies) runs the same choice instead of profiling again, so
    that it computes what the uninterrupted run would have (bitwise on the
    CPU). None: profile again (a fresh start, ``--two-bp``/``--no-two-bp``,
    ``--schedule auto`` or ``--recompute auto``, which choose for themselves, a
    checkpoint without a choice, or other stages).
    """
    if cfg.two_bp is not None or cfg.schedule == "auto" or cfg.recompute == "auto":
        return None
    source = resume_source(cfg)
    if source is None:
        return None
    saved = read_manifest(source).get("meta", {}).get("two_bp_split")
    if not saved or saved.get("layout") != split_layout(cfg, world_size):
        return None
    return [bool(b) for b in saved["split"]]


def _ran_split(pipe: Pipeline, cfg: TrainConfig) -> list[bool] | None:
    """The stages this run split by its own choice (two_bp unset), or None."""
    if cfg.two_bp is not None:
        return None
    if pipe.two_bp_choice is not None:
        return list(pipe.two_bp_choice.split)
    given = pipe.options.two_bp
    return list(given) if isinstance(given, (list, tuple)) else None


def save_due(cfg: TrainConfig, done: int) -> bool:
    """True if the run saves a checkpoint after ``done`` steps."""
    if not cfg.save:
        return False
    if done == last_step(cfg):
        return True
    return cfg.save_every > 0 and done % cfg.save_every == 0


def save(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    history: History,
    *,
    last: bool = False,
) -> Path:
    """Write this run's checkpoint after ``history.step`` steps. Collective.

    With ``--async-save`` it is written in the background, except the run's
    last (at its last step, or ``last``: it stops early), which is complete
    when this returns (as is any earlier one).
    """
    meta: dict[str, Any] = {"config": dataclasses.asdict(cfg), "step": history.step}
    split = _ran_split(pipe, cfg)
    if split is not None:
        meta["two_bp_split"] = {
            "split": split,
            "layout": split_layout(cfg, pipe.topology.members.size),
        }
    return pipe.save(
        checkpoint_root(cfg),
        optimizer,
        extra=dataclasses.asdict(history),
        step=history.step,
        meta=meta,
        keep=cfg.keep_checkpoints,
        async_save=cfg.async_save and not last and history.step < last_step(cfg),
    )
