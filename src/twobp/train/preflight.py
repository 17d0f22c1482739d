"""The options of a ``twobp train`` run, checked before any rank starts.

Every option whose valid values are known without running the model is
checked here, in the process that starts the ranks, with the rules the ranks
themselves apply: the schedule is prepared as every rank will prepare it
(:func:`twobp.schedule.prepare`, the one preparation pass), the partition is checked
against the model's block count (:func:`twobp.runtime.setup.stage_blocks.stage_counts`,
the model built on the meta device, which allocates nothing), the data file
and the checkpoint to resume from are looked at, and the output folder must
be writable and hold no checkpoints of another run (see
:mod:`twobp.train.out_folder`). A mistake is then one :class:`OptionError`
naming the option, not the same failure on every rank.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from twobp.config import check_writable
from twobp.engine.autocast import check_autocast_dtype
from twobp.models import build_model
from twobp.runtime.base.group import default_device
from twobp.runtime.setup.auto.plan import AUTO
from twobp.runtime.setup.stage_blocks import stage_counts
from twobp.schedule import Schedule, ScheduleConfigError, ScheduleError, prepare
from twobp.sim.cost_io import format_amount, parse_amount
from twobp.sim.recompute import RECOMPUTE_AUTO
from twobp.train.checkpointing import check_resume
from twobp.train.config import TrainConfig, parse_partition, run_name, tensor_sizes
from twobp.train.data import check_text_file
from twobp.train.out_folder import check_out_folder
from twobp.train.task import AUTOCAST_DTYPES, DTYPES, loss_scale_mode, model_overrides


class OptionError(ValueError):
    """An option of a training run that cannot work; the message names it and what to do."""


def check_config(cfg: TrainConfig, n_ranks: int | None = None) -> None:
    """Reject options that cannot work, before any process starts.

    Args:
        cfg: the run's options.
        n_ranks: ranks of the group (default ``cfg.ranks``; under torchrun,
            the world size).

    Raises:
        OptionError: naming the option and what to change.
    """
    ranks = cfg.ranks if n_ranks is None else n_ranks
    _check_numbers(cfg)
    check_dtype(cfg)
    try:
        loss_scale_mode(cfg)
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    n_blocks = _model_blocks(cfg)
    if ranks % cfg.data_parallel:
        raise OptionError(
            f"--data-parallel {cfg.data_parallel}: {ranks} ranks do not form "
            f"{cfg.data_parallel} copies of a pipeline; start data-parallel x pipeline ranks"
        )
    _check_tensor_parallel(cfg, ranks)
    _check_shard_parameters(cfg)
    _check_memory_limit(cfg, ranks // cfg.data_parallel // min(tensor_sizes(cfg)))
    if cfg.schedule != AUTO:
        schedule = _schedule(cfg, ranks // cfg.data_parallel // min(tensor_sizes(cfg)))
        _check_partition(cfg, n_blocks, schedule)
    if cfg.data is not None and cfg.model not in ("resnet", "deepspeech"):
        try:
            check_text_file(cfg.data, cfg.seq_len)
        except (OSError, ValueError) as exc:
            raise OptionError(str(exc)) from None
    try:
        check_writable("--out", cfg.out, folder=True)
        check_resume(cfg)
        check_out_folder(cfg)
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def _check_shard_parameters(cfg: TrainConfig) -> None:
    """Refuse what ``--shard-parameters`` cannot run yet."""
    if cfg.scatter_each_w and not cfg.shard_parameters:
        raise OptionError("--scatter-each-w needs --shard-parameters")
    if not cfg.shard_parameters:
        return
    # Chimera and DualPipe hold each stage on two ranks of one copy: they shard over those.
    two_pipelines = cfg.schedule in ("chimera", "dualpipe")
    problems = {
        "--data-parallel 1: give 2 or more copies to shard over (or --schedule chimera or "
        "dualpipe, whose two pipelines hold each stage twice)": cfg.data_parallel < 2
        and not two_pipelines,
    }
    chosen = [text for text, on in problems.items() if on]
    if chosen:
        raise OptionError(f"--shard-parameters does not take {'; '.join(chosen)}")


def _check_numbers(cfg: TrainConfig) -> None:
    at_least: dict[str, tuple[float | None, float]] = {
        "ranks": (cfg.ranks, 1),
        "data_parallel": (cfg.data_parallel, 1),
        "steps": (cfg.steps, 1),
        "microbatches": (cfg.microbatches if isinstance(cfg.microbatches, int) else None, 1),
        "auto_trials": (cfg.auto_trials, 0),
        "batch_size": (cfg.batch_size, 1),
        "seq_len": (cfg.seq_len, 1),
        "stages_per_rank": (cfg.stages_per_rank, 1),
        "weight_group_size": (cfg.weight_group_size, 1),
        "threads": (cfg.threads, 1),
        "log_every": (cfg.log_every, 1),
        "save_every": (cfg.save_every, 0),
        "keep_checkpoints": (cfg.keep_checkpoints, 1),
        "stop_after": (cfg.stop_after, 1),
        "warmup": (cfg.warmup, 0),
        "lr": (cfg.lr, 0),
        "weight_decay": (cfg.weight_decay, 0),
        "grad_clip": (cfg.grad_clip, 0),
    }
    for name, (value, least) in at_least.items():
        # Written so that NaN fails too; no option takes an infinite value.
        if value is not None and not (value >= least and math.isfinite(value)):
            raise OptionError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if not (cfg.timeout > 0 and math.isfinite(cfg.timeout)):
        raise OptionError(f"--timeout must be a number of seconds > 0, got {cfg.timeout}")
    if cfg.microbatches == AUTO:
        if cfg.schedule != AUTO:
            raise OptionError(
                "--microbatches auto is chosen by --schedule auto: add it, or give a count"
            )
        if cfg.batch_size % cfg.data_parallel:
            raise OptionError(
                f"--batch-size {cfg.batch_size} does not divide into {cfg.data_parallel} copies; "
                "pick a multiple of --data-parallel"
            )
        return
    if not isinstance(cfg.microbatches, int):
        raise OptionError(f"--microbatches must be a count or 'auto', got {cfg.microbatches!r}")
    if cfg.batch_size < cfg.microbatches * cfg.data_parallel:
        copies = f" x {cfg.data_parallel} copies" if cfg.data_parallel > 1 else ""
        raise OptionError(
            f"--batch-size {cfg.batch_size} holds fewer samples than {cfg.microbatches} "
            f"micro-batches{copies}; pass at least --microbatches"
            + (" x --data-parallel" if cfg.data_parallel > 1 else "")
            + " samples (a batch that does not divide splits into micro-batches of sizes "
            "that differ by one)"
        )
    if cfg.min_seq_len is not None and not 1 <= cfg.min_seq_len <= cfg.seq_len:
        raise OptionError(
            f"--min-seq-len {cfg.min_seq_len} must be from 1 to --seq-len {cfg.seq_len}"
        )


def check_dtype(cfg: TrainConfig, device: torch.device | None = None) -> None:
    """Check that the ranks' device can compute in ``--dtype`` (under ``--autocast`` if given).

    Args:
        cfg: the run's options.
        device: the device to check (default: the one a rank of this machine
            would pick, its GPU if CUDA is available, else the CPU).

    Raises:
        OptionError: naming ``--dtype`` or ``--autocast`` and what to change.
    """
    if cfg.dtype not in DTYPES:
        raise OptionError(f"--dtype {cfg.dtype}: choose from {', '.join(DTYPES)}")
    device = default_device() if device is None else device
    dtype = DTYPES[cfg.dtype]
    if cfg.autocast:
        if cfg.dtype not in AUTOCAST_DTYPES:
            raise OptionError(
                f"--autocast computes in a lower precision than the float32 parameters: give "
                f"--dtype {' or '.join(AUTOCAST_DTYPES)} with it (got --dtype {cfg.dtype}), "
                f"or leave --autocast out"
            )
        try:
            check_autocast_dtype(device, dtype)
        except ValueError as exc:
            raise OptionError(f"--dtype {cfg.dtype} --autocast: {exc}") from None
        return
    if dtype in (torch.float32, torch.float64):
        return
    try:
        with torch.no_grad():
            a = torch.ones(2, 2, dtype=dtype, device=device)
            a @ a
    except (RuntimeError, TypeError) as exc:
        raise OptionError(
            f"--dtype {cfg.dtype}: {device} cannot compute in {dtype} ({exc}); use --dtype "
            f"float32, or --dtype {cfg.dtype} --autocast where autocast supports it"
        ) from None


HF_EXTRA = "--hf-config needs the transformers extra (pip install twobp[transformers])"


def transformers_importable() -> bool:
    """True if ``transformers`` can be imported here."""
    return importlib.util.find_spec("transformers") is not None


def _check_tensor_parallel(cfg: TrainConfig, ranks: int) -> None:
    """Refuse a --tensor-parallel run that could not start.

    Raises:
        OptionError: naming the option and what to change.
    """
    sizes = tensor_sizes(cfg)
    given = ",".join(map(str, sizes))
    if min(sizes) < 1:
        raise OptionError(f"--tensor-parallel must be at least 1, got {given}")
    if sizes == [1]:
        return
    copies = cfg.data_parallel
    if not any(ranks % (copies * t) == 0 for t in sizes):
        raise OptionError(
            f"--tensor-parallel {given}: {ranks} ranks do not form {copies} "
            f"data-parallel x pipeline x {given} tensor-parallel ranks; start a multiple of "
            f"{copies * min(sizes)} ranks"
        )
    family = cfg.hf_config or cfg.model
    if max(sizes) > 1 and family != "llama":
        raise OptionError(
            f"--tensor-parallel {given}: a plan ships for llama (--model llama, --hf-config "
            f"llama), not {family}"
        )
    problems = {
        "--schedule auto: name a schedule": cfg.schedule == AUTO and len(sizes) == 1,
        "a schedule by name: give one size, or --schedule auto": cfg.schedule != AUTO
        and len(sizes) > 1,
        "--microbatches auto: give a number": not isinstance(cfg.microbatches, int),
        "--partition balanced: give the sizes, or uniform": cfg.partition == "balanced"
        and len(sizes) == 1,
        "--recompute auto: name a mode": cfg.recompute == "auto",
    }
    chosen = [text for text, on in problems.items() if on]
    if chosen:
        raise OptionError(f"--tensor-parallel {given} does not take {'; '.join(chosen)}")


def _model_blocks(cfg: TrainConfig) -> int:
    """The number of blocks of the run's model (built on the meta device)."""
    if cfg.hf_config is not None:
        if not transformers_importable():
            raise OptionError(HF_EXTRA)
        from twobp.integrations import SPEECH_FAMILIES
        from twobp.integrations.transformers import SIZES, n_blocks

        if cfg.size not in SIZES:
            raise OptionError(f"--size {cfg.size}: --hf-config takes {' or '.join(SIZES)}")
        if cfg.hf_config in SPEECH_FAMILIES:
            from twobp.integrations.wav2vec2 import SIZES as SPEECH_SIZES

            return int(SPEECH_SIZES[cfg.size]["num_hidden_layers"]) + 2
        return n_blocks(cfg.size)
    try:
        spec = build_model(cfg.model, cfg.size, device="meta", seed=None, **model_overrides(cfg))
    except ValueError as exc:
        raise OptionError(f"--size {cfg.size}: {exc}") from None
    return spec.n_blocks


def _parameter_bytes(cfg: TrainConfig) -> float | None:
    """The bytes of the run's model parameters (each tied weight once), in the dtype they
    train in; None for a Hugging Face model (not built here)."""
    if cfg.hf_config is not None:
        return None
    spec = build_model(cfg.model, cfg.size, device="meta", seed=None, **model_overrides(cfg))
    unique = {id(p): p for block in spec.blocks for p in block.parameters()}
    dtype = torch.float32 if cfg.autocast else DTYPES.get(cfg.dtype, torch.float32)
    return float(sum(p.numel() for p in unique.values()) * dtype.itemsize)


def _check_memory_limit(cfg: TrainConfig, pipeline_ranks: int = 1) -> None:
    rebuilding = cfg.recompute == RECOMPUTE_AUTO
    if cfg.memory_limit is None:
        if rebuilding:
            raise OptionError(
                "--recompute auto rebuilds only the stashes that do not fit --memory-limit; "
                "give --memory-limit (e.g. 2GiB), or another --recompute mode"
            )
        return
    if cfg.schedule != AUTO and not rebuilding:
        raise OptionError(
            f"--memory-limit bounds the choice of --schedule auto (or, with --recompute auto, "
            f"what is rebuilt); with --schedule {cfg.schedule} it does nothing: drop it, or "
            "use --schedule auto or --recompute auto"
        )
    try:
        limit = parse_amount(cfg.memory_limit)
    except ValueError as exc:
        raise OptionError(f"--memory-limit {cfg.memory_limit}: {exc}") from None
    if not limit > 0:
        raise OptionError(f"--memory-limit must be > 0 bytes, got {cfg.memory_limit}")
    weights = _parameter_bytes(cfg)
    # Some rank holds at least its share of the parameters and their gradients.
    floor = None if weights is None else 2 * weights / max(1, pipeline_ranks)
    if floor is not None and limit < floor:
        raise OptionError(
            f"--memory-limit {cfg.memory_limit}: no schedule fits, the parameters of "
            f"{run_name(cfg)} and their gradients alone need at least {format_amount(floor)} "
            f"per rank on {pipeline_ranks} pipeline rank(s); raise it or drop it"
        )


def _schedule(cfg: TrainConfig, n_ranks: int) -> Schedule:
    """The schedule every rank will prepare from the options (with 2BP where the
    default chooses it per stage: the stages are the same either way)."""
    try:
        return prepare(
            cfg.schedule,
            n_ranks=n_ranks,
            n_microbatches=cfg.microbatches if isinstance(cfg.microbatches, int) else None,
            two_bp=cfg.two_bp is not False,
            policy=cfg.policy,
            stages_per_rank=cfg.stages_per_rank,
            data_parallel=cfg.data_parallel,
        )
    except (ScheduleConfigError, ScheduleError) as exc:
        raise OptionError(f"--schedule {cfg.schedule}: {exc}") from None


def _check_partition(cfg: TrainConfig, n_blocks: int, schedule: Schedule) -> None:
    try:
        stage_counts(n_blocks, schedule.pipeline_stages, parse_partition(cfg.partition))
    except ValueError as exc:
        where = f"{schedule.pipeline_stages} stages, {run_name(cfg)} has {n_blocks} blocks"
        message = str(exc).removeprefix(f"--partition {cfg.partition!r}: ")
        raise OptionError(f"--partition {cfg.partition} ({where}): {message}") from None
