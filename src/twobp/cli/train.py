"""``twobp train``: the main job (see :mod:`twobp.train`)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from pathlib import Path
from typing import Any

from twobp.cli.errors import UsageError
from twobp.config import add_arguments, read_toml
from twobp.train.config import TrainConfig
from twobp.train.console import Console


def register(subparsers: Any) -> None:
    """Add the ``train`` sub-command."""
    parser = subparsers.add_parser(
        "train",
        help="train a reference model with a pipeline schedule (the main job)",
        description=(
            "Train a reference model over local ranks (or the ranks of torchrun) and write a "
            "report: throughput, bubble ratio, peak memory per rank, loss curve and the last "
            "step's timeline. Defaults: the tiny LLaMA-like model as a byte-level language "
            "model on Python's own sources, 2 ranks, 1f1b with 2BP on the stages where a profile "
            "of the blocks says it pays (--two-bp: every stage). Checkpoints go to "
            "OUT/checkpoints, every --save-every steps and at the end; --resume OUT continues a "
            "run where it stopped (under torchrun --max-restarts, pass --resume auto). A new run "
            "into an OUT that holds checkpoints of another run is refused (--overwrite replaces "
            "them). Ctrl-C, SIGTERM or SIGHUP ends the run after the step in flight with a "
            "checkpoint and prints the command that continues it (exit code 130), also into "
            "OUT/train.log, which keeps what the command printed if the terminal or the pipe "
            "it printed to is gone; a second Ctrl-C stops at once. Steps skipped for a float16 "
            "overflow or a non-finite loss are told as they happen and counted at the end; a "
            "run that skips all its steps fails (exit code 1). Options are checked before any "
            "rank starts; if a rank fails, the command prints one line per failed rank and "
            "writes the tracebacks to OUT/errors.log (exit code 1). With --config FILE.toml the "
            "options come from a file (one key per option), and those given here override it; "
            "every run writes the options it ran with to OUT/config.toml."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        help="read the options from a TOML file: one key per option (seq_len or seq-len); "
        "options given on the command line override it (OUT/config.toml of a run repeats it)",
    )
    add_arguments(parser, TrainConfig, only_given=True)
    parser.set_defaults(func=_run)


def train_config(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, Any]]:
    """The run's options: the ``--config`` file's, overridden by those on the command line.

    Returns:
        The options, and those that came from the file (by field name).

    Raises:
        UsageError: naming the file and the key, if the file cannot be read or
            a key or value is wrong.
    """
    from_file: dict[str, Any] = {}
    if args.config is not None:
        try:
            from_file = read_toml(TrainConfig, args.config)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {name: value for name, value in vars(args).items() if name in names}
    if isinstance(given.get("seq_len"), tuple):
        given["min_seq_len"], given["seq_len"] = given["seq_len"]
    return TrainConfig(**{**from_file, **given}), {
        name: value for name, value in from_file.items() if name not in given
    }


INTERRUPTED_EXIT_CODE = 130
"""Exit code of a run stopped by Ctrl-C, SIGTERM or SIGHUP (128 + SIGINT, as a shell reports
it)."""


def _run(args: argparse.Namespace) -> int:
    from twobp.runtime import LaunchError, PipelineError
    from twobp.train.failures import failure_summary
    from twobp.train.out_folder import with_run_folder
    from twobp.train.preflight import OptionError
    from twobp.train.run import run_training
    from twobp.train.skipped import every_step_skipped
    from twobp.train.stopping import TrainingInterrupted

    cfg, from_file = train_config(args)
    cfg = with_run_folder(cfg)
    # What the command prints also goes to OUT/train.log, and goes on there if stdout and
    # stderr are gone (a closed pipe, a terminal that hung up).
    console = Console(Path(cfg.out))
    try:
        summary = run_training(cfg)
    except OptionError as exc:
        raise UsageError(_name_the_file(str(exc), from_file, args.config)) from exc
    except TrainingInterrupted as exc:
        if exc.summary is not None:
            _print_summary(console, cfg, exc.summary)
            saved = f", saved in {exc.checkpoint}" if exc.checkpoint else "; nothing saved"
            console.say(f"interrupted after step {exc.step} of {cfg.steps}{saved}")
            if exc.checkpoint:
                console.say(f"continue with: {_continue_with(cfg)}")
        return INTERRUPTED_EXIT_CODE
    except KeyboardInterrupt:
        console.warn("interrupted")
        _print_resume_hint(console, cfg)
        return INTERRUPTED_EXIT_CODE
    except LaunchError as exc:
        console.warn(f"twobp train: {failure_summary(exc, Path(cfg.out), cfg.verbose)}")
        _print_resume_hint(console, cfg)
        return 1
    except PipelineError as exc:
        # This rank's error under torchrun, which then ends or restarts the group.
        console.warn(f"twobp train: {exc}")
        return 1
    if summary is not None:
        _print_summary(console, cfg, summary)
        if summary["steps_run"] < cfg.steps:
            console.say(
                f"stopped after step {summary['steps_run']} of {cfg.steps}; continue with the "
                f"same options and --resume {cfg.out}"
            )
        nothing_learnt = every_step_skipped(summary)
        if nothing_learnt is not None:
            console.warn(f"twobp train: {nothing_learnt}")
            return 1
    return 0


def _print_summary(console: Console, cfg: TrainConfig, summary: dict[str, Any]) -> None:
    from twobp.train.report import memory_line, throughput
    from twobp.train.skipped import skipped_text

    skipped = skipped_text(summary)
    console.say(
        f"done: loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}, "
        f"held-out {summary['eval_loss']:.3f}; {throughput(summary)}; "
        f"bubble {summary['bubble_ratio']:.3f}; report in {cfg.out}/report.md"
        + ("" if skipped is None else f"; {skipped}")
    )
    memory = memory_line(summary.get("memory_per_rank", {}))
    if memory is not None:
        console.say(memory)


def _print_resume_hint(console: Console, cfg: TrainConfig) -> None:
    """After a failure or a hard stop: the latest checkpoint, and how to continue from it."""
    from twobp.runtime.errors import CheckpointError
    from twobp.runtime.state.checkpoint import latest_checkpoint, read_manifest
    from twobp.train.checkpointing import checkpoint_root, last_step

    latest = latest_checkpoint(checkpoint_root(cfg))
    if latest is None:
        return
    try:
        step = int(read_manifest(latest)["step"])
    except (CheckpointError, KeyError, ValueError):
        return
    if step >= last_step(cfg):
        return
    console.warn(
        f"the latest checkpoint is {latest} (step {step}); continue with: {_continue_with(cfg)}"
    )


def _continue_with(cfg: TrainConfig) -> str:
    from twobp.runtime.base.group import launched_by_env

    if launched_by_env():
        return f"the same torchrun command with --resume {cfg.out} (or --resume auto)"
    return resume_command(cfg)


def resume_command(cfg: TrainConfig) -> str:
    """The ``twobp train`` command that continues ``cfg``'s run from its latest checkpoint.

    Every option that differs from its default, then ``--resume OUT``.
    """
    words = ["twobp", "train"]
    for option in dataclasses.fields(TrainConfig):
        value = getattr(cfg, option.name)
        if option.name in ("out", "resume", "overwrite") or value == option.default:
            continue
        flag = "--" + option.name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            words += [flag, str(value)]
    if cfg.out != _DEFAULT_OUT:
        words += ["--out", cfg.out]
    return shlex.join([*words, "--resume", cfg.out])


_DEFAULT_OUT = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "out")


def _name_the_file(message: str, from_file: dict[str, Any], path: str | None) -> str:
    """``message`` about ``--some-option``, saying so if the file gave that option."""
    match = re.match(r"--([a-z][a-z0-9-]*)", message)
    name = match.group(1).replace("-", "_") if match else None
    if name is None or name not in from_file:
        return message
    return f"{path}, key {name}: {message}"
