"""Functions the reliability tests run on every rank of a launched group.

Starting processes costs seconds, so one launch tries many bad inputs in a row:
each is caught on every rank and recorded as ``(error class, message)``. A
session that ends with a fatal failure (a rank raising out of ``fn``, a stall,
a kill) saves what it recorded into a folder first, since the launcher returns
no result then.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from runtime_models import build_blocks, loss_fn, make_batch
from runtime_workers import needed_batches
from twobp.runtime import Pipeline
from twobp.runtime.setup.fingerprint import ValuesDifferWarning
from twobp.schedule import Kind, generate

N_MB = 4
BATCH = 2 * N_MB
FATAL_TIMEOUT = 20.0
"""Seconds the last pipeline of the bad-inputs session waits on a peer: far more than
learning of a failure takes, even on a loaded machine."""
MID_STEP_TIMEOUT = 20.0
"""Seconds the pipelines of the mid-step failures wait on a peer (likewise)."""

Outcome = tuple[str, str] | None
"""``(error class name, message)``, or None if the call returned."""


def outcome_of(call: Callable[[], Any]) -> Outcome:
    """What ``call`` raised, or None."""
    try:
        call()
    except Exception as exc:
        return (type(exc).__name__, str(exc))
    return None


def save_outcomes(folder: str, outcomes: dict[str, Any]) -> None:
    """Write this rank's outcomes into ``folder`` (read back by the test)."""
    path = Path(folder) / f"rank{dist.get_rank()}.pkl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(outcomes))
    tmp.replace(path)


def mlp(timeout: float, **options: Any) -> Pipeline:
    """The test MLP as a pipeline (blocks from ``options["blocks"]`` if given)."""
    blocks = options.pop("blocks", None) or build_blocks("mlp")
    options.setdefault("n_microbatches", N_MB)
    options.setdefault("schedule", "1f1b")
    return Pipeline(blocks, loss_fn("mlp"), device="cpu", timeout=timeout, **options)


# -- bad inputs ------------------------------------------------------------------------


def _construction_cases(rank: int, timeout: float) -> dict[str, Callable[[], Any]]:
    def wider_block_4() -> list[nn.Module]:
        blocks = build_blocks("mlp")
        if rank == 1:
            blocks[4] = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).double()
        return blocks

    def one_more_block() -> list[nn.Module]:
        blocks = build_blocks("mlp")
        return [*blocks, nn.Identity()] if rank == 1 else blocks

    four_rank_schedule = generate("1f1b", 4, N_MB)
    return {
        "unknown schedule": lambda: mlp(timeout, schedule="2f2b"),
        "unknown policy": lambda: mlp(timeout, two_bp_policy="sometimes"),
        "more stages than blocks": lambda: mlp(timeout, blocks=build_blocks("mlp")[:1]),
        "partition sum": lambda: mlp(timeout, partition=[3, 3]),
        "too few micro-batches": lambda: mlp(
            timeout, schedule="interleaved-1f1b", n_microbatches=3
        ),
        "world size": lambda: mlp(timeout, schedule=four_rank_schedule, n_microbatches=None),
        "unknown nonfinite": lambda: mlp(timeout, nonfinite="ignore"),
        "bad partition on one rank": lambda: mlp(timeout, partition=[5, 6] if rank else None),
        "options differ": lambda: mlp(timeout, partition=[3, 7] if rank else None),
        "transfer options differ": lambda: mlp(timeout, order_only_matching=bool(rank)),
        "blocks differ": lambda: mlp(timeout, blocks=wider_block_4()),
        "block count differs": lambda: mlp(timeout, blocks=one_more_block()),
    }


def _step_cases(pipe: Pipeline, rank: int) -> dict[str, Callable[[], Any]]:
    x, y = make_batch("mlp", 0, BATCH)
    return {
        "fewer rows than micro-batches": lambda: pipe.step(*needed_batches(pipe, x[:3], y[:3])),
        "inputs missing": lambda: pipe.step(None, y),
        "targets missing": lambda: pipe.step(x, None),
        "batch sizes differ": lambda: pipe.step(*needed_batches(pipe, x, torch.cat([y, y[:4]]))),
        "inputs not tensors": lambda: pipe.step([1, 2, 3], y),  # type: ignore[arg-type]
        "different calls": lambda: pipe.step(x, y) if rank == 0 else pipe.eval_step(x, y),
    }


def bad_inputs_session(folder: str, timeout: float) -> None:
    """Try every bad input on both ranks, then mid-step failures, then raise for real."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for name, call in _construction_cases(rank, timeout).items():
        out[name] = outcome_of(call)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shifted = build_blocks("mlp")
        if rank == 1:
            with torch.no_grad():
                shifted[2][0].weight.add_(1.0)
        mlp(timeout, blocks=shifted)
    out["values differ"] = [str(w.message) for w in caught if w.category is ValuesDifferWarning]
    merged = mlp(timeout, schedule="zb-h1", two_bp=False)
    out["zb-h1 without 2BP"] = sorted({a.kind.value for a in merged.schedule.actions[rank]})
    assert Kind.BACKWARD_WEIGHT.value not in out["zb-h1 without 2BP"]

    pipe = mlp(timeout)
    for name, call in _step_cases(pipe, rank).items():
        out[name] = outcome_of(call)
    x, y = make_batch("mlp", 0, BATCH)
    out["usable after bad inputs"] = pipe.step(*needed_batches(pipe, x, y))
    out["usable grads"] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.zero_grad()
    nan_targets = y.clone()
    nan_targets[5, 0] = float("nan")  # micro-batch 2
    out["nan raise"] = outcome_of(lambda: pipe.step(x, nan_targets))
    out["nan raise grads"] = [p.grad is None for p in pipe.parameters()]
    skipping = mlp(timeout, nonfinite="skip")
    inf_targets = y.clone()
    inf_targets[0, 0] = float("inf")
    out["inf skip loss"] = skipping.step(*needed_batches(skipping, x, inf_targets))
    out["inf skip flags"] = (
        skipping.last_step_skipped,
        skipping.skipped_steps,
        [p.grad is None for p in skipping.parameters()],
    )
    out["after skip"] = (skipping.step(x, y), skipping.last_step_skipped, skipping.step_count)
    save_outcomes(folder, out)

    out.update(_mid_step_failures(rank))
    save_outcomes(folder, out)
    dist.barrier()
    # Finally a rank raises out of its function: its process ends, the peer must not hang
    # (the peer would wait FATAL_TIMEOUT for it; the launcher gives it longer to fail on
    # its own).
    fatal = mlp(FATAL_TIMEOUT, blocks=[*build_blocks("mlp")[:9], _RaisesOnRank1(rank)])
    fatal.step(*needed_batches(fatal, x, y))


class _RaisesOnRank1(nn.Linear):
    def __init__(self, rank: int) -> None:
        torch.manual_seed(0)
        super().__init__(8, 4, dtype=torch.float64)
        self.rank = rank

    def forward(self, x: Tensor) -> Tensor:
        if self.rank == 1:
            raise RuntimeError("block 9 failed on purpose")
        return super().forward(x)


class _DtypeFlip(nn.Module):
    """Passes float64 through on its first call, float32 afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x if self.calls <= N_MB else x.float()


def _non_scalar_loss(out: Tensor, y: Tensor) -> Tensor:
    return (out - y) ** 2


def _mid_step_failures(rank: int) -> dict[str, Any]:
    """Errors in the middle of a step, caught on the rank that raises them.

    The failing rank completes the step's transfers and every rank learns of
    the failure at the step's end. Each case runs in a group of its own.
    """
    out: dict[str, Any] = {}
    x, y = make_batch("mlp", 0, BATCH)
    timeout = MID_STEP_TIMEOUT
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    pipe = Pipeline(
        build_blocks("mlp"), _non_scalar_loss, n_microbatches=N_MB, device="cpu", group=group,
        timeout=timeout,
    )  # fmt: skip
    out["non-scalar loss"] = outcome_of(lambda: pipe.step(*needed_batches(pipe, x, y)))

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    blocks = build_blocks("mlp")
    blocks[4] = nn.Sequential(blocks[4], _DtypeFlip())
    pipe = Pipeline(
        blocks, loss_fn("mlp"), n_microbatches=N_MB, device="cpu", group=group, timeout=timeout
    )
    pipe.step(*needed_batches(pipe, x, y))
    out["dtype change"] = outcome_of(lambda: pipe.step(*needed_batches(pipe, x, y)))
    return out


# -- a stalled rank ----------------------------------------------------------------------


class StallingLoss:
    """A loss whose call of the second step never returns."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, out: Tensor, y: Tensor) -> Tensor:
        self.calls += 1
        while self.calls > N_MB:  # until the launcher ends this process
            signal.pause()
        return loss_fn("mlp")(out, y)


def stalled_rank_session(timeout: float) -> None:
    """Rank 1 (last stage) stalls in the loss of its second step."""
    pipe = Pipeline(
        build_blocks("mlp"), StallingLoss(), n_microbatches=N_MB, device="cpu", timeout=timeout
    )
    x, y = make_batch("mlp", 0, BATCH)
    pipe.step(*needed_batches(pipe, x, y))
    pipe.step(*needed_batches(pipe, x, y))


# -- checkpoints --------------------------------------------------------------------------


def die_while_writing() -> None:
    """From now on, this process dies by SIGKILL half-way through writing checkpoint data."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def write_half_then_die(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        (Path(self.path) / f"__{dist.get_rank()}_0.distcp").write_bytes(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    FileSystemWriter.write_data = write_half_then_die  # type: ignore[method-assign]


def conv(timeout: float, **options: Any) -> Pipeline:
    """The test convolutional model (BatchNorm buffers) as a pipeline."""
    options.setdefault("n_microbatches", N_MB)
    return Pipeline(build_blocks("conv"), loss_fn("conv"), device="cpu", timeout=timeout, **options)


def train_steps(
    pipe: Pipeline, optimizer: torch.optim.Optimizer, steps: range, model: str = "conv"
) -> list[float]:
    """AdamW steps on the batches of ``steps`` (of the conv model by default); the losses."""
    losses = []
    for step in steps:
        x, y = make_batch(model, step, BATCH)
        losses.append(pipe.step(*needed_batches(pipe, x, y)))
        optimizer.step()
        pipe.zero_grad()
    return losses


def _state(pipe: Pipeline) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def dropout_blocks() -> list[nn.Module]:
    """The test MLP with dropout in a block of each half (each rank of 2 draws its own masks)."""
    blocks = build_blocks("mlp")
    for i in (2, 7):
        blocks[i] = nn.Sequential(blocks[i], nn.Dropout(0.3))
    return blocks


def _resume_with_dropout(root: Path, rank: int, timeout: float) -> dict[str, Any]:
    """Save a model with dropout, go on; load it after drawing other numbers, go on."""
    out: dict[str, Any] = {}
    blocks = dropout_blocks()
    torch.manual_seed(1000 + rank)  # each rank its own random stream
    saved = mlp(timeout, blocks=blocks)
    optimizer = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    train_steps(saved, optimizer, range(2), "mlp")
    saved.save(root / "dropout", optimizer)
    out["continued losses"] = train_steps(saved, optimizer, range(2, 4), "mlp")
    out["continued state"] = _state(saved)
    resumed = mlp(timeout, blocks=dropout_blocks())
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    torch.manual_seed(7)  # the same stream on both ranks, and not the saved one
    resumed.load(root / "dropout", optimizer)
    out["resumed losses"] = train_steps(resumed, optimizer, range(2, 4), "mlp")
    out["resumed state"] = _state(resumed)
    return out


def _damaged_copies(saved: Path, root: Path) -> None:
    """Copies of ``saved`` with rank 1's file damaged.

    ``damaged``: a folder of checkpoints whose latest (step 2) lost the end of
    that file, after an intact step 1. ``altered``: one byte of it flipped, in
    the middle of a tensor's data, so that its size is as saved.
    """
    import shutil

    shutil.copytree(saved, root / "damaged" / "step-00000001")
    shutil.copytree(saved, root / "damaged" / "step-00000002")
    data = root / "damaged" / "step-00000002" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    shutil.copytree(saved, root / "altered")
    data = root / "altered" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


@contextmanager
def held_writes(hold: Callable[[], None]) -> Iterator[None]:
    """Every checkpoint data write of this process calls ``hold`` first (in DCP's thread,
    for a background save): a write held back, or one that fails."""
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def held(self: Any, plan: Any, planner: Any) -> Any:
        hold()
        return write(self, plan, planner)

    FileSystemWriter.write_data = held  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileSystemWriter.write_data = write  # type: ignore[method-assign]


def _held_background_saves(pipe: Pipeline, optimizer: Any, root: Path) -> dict[str, Any]:
    """Background saves whose write waits until after the next step, or fails on rank 1."""
    out: dict[str, Any] = {}
    release = threading.Event()
    events: list[str] = []

    def wait_for_release() -> None:
        events.append("write waits")
        if not release.wait(timeout=30):
            events.append("never released")

    with held_writes(wait_for_release):
        out["held state"] = _state(pipe)
        out["held path"] = str(pipe.save(root / "held", optimizer, step=8, async_save=True))
        events.append("save returned")
        # The weights and the optimizer's state change while the write waits: the
        # checkpoint must hold what they were at the save.
        train_steps(pipe, optimizer, range(5, 6))
        events.append("stepped")
        out["held after step"] = _state(pipe)
        release.set()
        out["held waited"] = str(pipe.wait_for_checkpoint())
    out["held events"] = events

    def fail_on_rank_1() -> None:
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")

    # (The writes run in DCP's thread after save returns: the failing writer stays in
    # place until their outcome is collected.)
    with held_writes(fail_on_rank_1):
        pipe.save(root / "failing", optimizer, step=9, async_save=True)
        out["failed write, next wait"] = outcome_of(pipe.wait_for_checkpoint)
    out["failed write, wait again"] = pipe.wait_for_checkpoint()
    with held_writes(fail_on_rank_1):
        pipe.save(root / "failing", optimizer, step=10, async_save=True)
        out["failed write, next save"] = outcome_of(
            lambda: pipe.save(root / "failing", optimizer, step=11)
        )
    return out


def checkpoint_session(folder: str, timeout: float, one_process: str) -> None:
    """Save, load into the same and another layout, fail to load, then die while saving.

    Also loads ``one_process``, a checkpoint of the conv model saved by one process
    after 2 steps, and trains it on for 2 steps.
    """
    rank = dist.get_rank()
    root = Path(folder)
    out: dict[str, Any] = {}
    from_one = conv(timeout)
    optimizer = torch.optim.AdamW(from_one.parameters(), lr=0.5)
    out["from one extra"] = from_one.load(one_process, optimizer)
    out["from one stages"] = sorted(from_one.stages)
    out["from one losses"] = train_steps(from_one, optimizer, range(2, 4))
    out["from one state"] = _state(from_one)
    out["dropout"] = _resume_with_dropout(root, rank, timeout)
    a = conv(timeout)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    out["losses before"] = train_steps(a, opt_a, range(2))
    out["saved path"] = str(
        a.save(root / "ckpt", opt_a, extra={"rank": rank, "position": 2}, meta={"note": "hi"})
    )
    out["saved state"] = _state(a)
    out["continued losses"] = train_steps(a, opt_a, range(2, 4))
    out["continued state"] = _state(a)

    b = conv(timeout)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.5)
    out["extra"] = b.load(root / "ckpt", opt_b)
    out["step count"] = b.step_count
    out["same layout losses"] = train_steps(b, opt_b, range(2, 4))
    out["same layout state"] = _state(b)

    c = conv(timeout, schedule="interleaved-1f1b", partition=[1, 4, 3, 2])
    opt_c = torch.optim.AdamW(c.parameters(), lr=0.5)
    c.load(root / "ckpt", opt_c)
    out["repartitioned losses"] = train_steps(c, opt_c, range(2, 4))
    out["repartitioned state"] = _state(c)

    other = mlp(timeout)
    out["other model"] = outcome_of(lambda: other.load(root / "ckpt"))
    out["missing"] = outcome_of(lambda: b.load(root / "nothing-here"))
    sgd = torch.optim.SGD(b.parameters(), lr=0.1)
    out["optimizer class"] = outcome_of(lambda: b.load(root / "ckpt", sgd))
    foreign = torch.optim.SGD([*b.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)
    out["foreign parameter"] = outcome_of(lambda: b.save(root / "bad", foreign))
    if rank == 0:
        broken = root / "broken"
        import shutil

        shutil.copytree(out["saved path"], broken)
        (broken / "__1_0.distcp").unlink()
    dist.barrier()
    before = _state(b)
    out["file of rank 1 missing"] = outcome_of(lambda: b.load(root / "broken", opt_b))
    if rank == 0:
        _damaged_copies(Path(out["saved path"]), root)
    dist.barrier()
    out["truncated"] = outcome_of(lambda: b.load(root / "damaged", opt_b))
    out["altered"] = outcome_of(lambda: b.load(root / "altered", opt_b))
    out["unchanged after failed load"] = all(
        torch.equal(before[k], v) for k, v in b.state_dict().items()
    )

    # Written in the background while the next step changes the weights.
    out["async state"] = _state(b)
    out["async path"] = str(b.save(root / "async", opt_b, step=7, async_save=True))
    train_steps(b, opt_b, range(4, 5))
    out["async waited"] = str(b.wait_for_checkpoint())
    out["nothing to wait for"] = b.wait_for_checkpoint()
    out.update(_held_background_saves(b, opt_b, root))

    # A checkpoint of one process, loaded by two ranks.
    d = conv(timeout)
    opt_d = torch.optim.AdamW(d.parameters(), lr=0.5)
    out["from one process extra"] = d.load(root / "single", opt_d)
    out["from one process losses"] = train_steps(d, opt_d, range(2, 4))
    out["from one process state"] = _state(d)

    out["crash saved"] = str(b.save(root / "crash", opt_b, step=1))
    out["crash state"] = _state(b)
    save_outcomes(folder, out)
    dist.barrier()
    if rank == 1:
        die_while_writing()
    b.save(root / "crash", opt_b, step=2)
