"""Functions the sharded-parameter (ZeRO-3) tests run on every rank of a launched group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runtime_models import LR, N_STEPS, build_blocks, loss_fn, make_batch
from twobp.runtime import Pipeline, PipelineConfigError

N_MB = 4
PART = 8  # samples per data-parallel copy and step
CLIP = 0.05  # small enough that every step clips


def _pipeline(schedule: str, **options: Any) -> Pipeline:
    return Pipeline(
        build_blocks("mlp"),
        loss_fn("mlp"),
        schedule=schedule,
        two_bp=True,
        device="cpu",
        timeout=60.0,
        **{"n_microbatches": N_MB, "data_parallel": 2, "shard_parameters": True, **options},
    )


def batch_of(step: int, micro: int, dp_size: int) -> tuple[Any, Any]:
    """The whole batch of optimizer step ``step``'s ``micro``-th accumulated step."""
    return make_batch("mlp", 10 * step + micro, PART * dp_size)


def _refused(call: Callable[[], object]) -> str:
    try:
        call()
    except PipelineConfigError as exc:
        return str(exc)
    return ""


def train(schedule: str, accumulate: int, recompute: str | None = None) -> dict[str, Any]:
    """3 clipped AdamW steps of ``accumulate`` pipeline steps each, parameters sharded."""
    torch.set_num_threads(1)
    pipe = _pipeline(schedule, recompute=recompute)
    # A V without an example input balances on its first step's inputs: plan on them now,
    # to shard the parameters and the optimizer as they will be held (else nothing happens).
    pipe.plan_on(batch_of(0, 0, pipe.dp_size)[0][pipe.dp_rank * PART : (pipe.dp_rank + 1) * PART])
    refused_plain = _refused(lambda: torch.optim.AdamW(pipe.parameters(), lr=LR))
    refused_named = _refused(lambda: dict(pipe.named_parameters()))
    optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
    held_at_w = _watch_weight_passes(pipe)
    # Between steps the full parameters hold nothing: only this rank's shards.
    between = [p.untyped_storage().nbytes() for p in pipe.state.parameters()]
    losses, norms, gathered = [], [], []
    for step in range(N_STEPS):
        for micro in range(accumulate):
            inputs, targets = batch_of(step, micro, pipe.dp_size)
            part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
            losses.append(pipe.step(inputs[part], targets[part]))
            gathered.append(any(p.untyped_storage().nbytes() for p in pipe.state.parameters()))
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        optimizer.step()
        if step == N_STEPS - 1:
            stats = pipe.memory_stats(optimizer)
        optimizer.zero_grad()
    full = sum(p.numel() * p.element_size() for p in pipe.state.parameters())
    return {
        "losses": losses,
        "norms": norms,
        "state": pipe.state_dict(),
        "between": between,
        "gathered after a step": gathered,
        "refused plain": refused_plain,
        "refused named": refused_named,
        "held at W": held_at_w,
        "stats": stats,
        # Parameters, gradients and AdamW's two moments, unsharded.
        "unsharded": 4 * full,
        "stage bytes": full,
    }


def _watch_weight_passes(pipe: Pipeline) -> list[tuple[int, int, bool]]:
    """For each W as it runs: ``(step, stage, whether its stage's full weights were held)``."""
    seen: list[tuple[int, int, bool]] = []
    for index, stage in pipe.stages.items():
        run = stage.weight
        params = list(stage.module.parameters())

        def watched(
            *args: Any, run: Any = run, params: Any = params, index: int = index, **kwargs: Any
        ) -> None:
            held = any(p.untyped_storage().nbytes() for p in params)
            seen.append((pipe.step_count, index, held))
            run(*args, **kwargs)

        stage.weight = watched  # type: ignore[method-assign]
    return seen


def train_many(cases: list[tuple[Any, ...]]) -> dict[str, Any]:
    """:func:`train` of every case, keyed by its text."""
    return {repr(c): train(*c) for c in cases}


def refusals() -> dict[str, Any]:
    """What ``shard_parameters=True`` refuses, with the messages."""
    torch.set_num_threads(1)
    out = {}
    out["one copy"] = _refused(
        lambda: Pipeline(
            build_blocks("mlp"),
            loss_fn("mlp"),
            n_microbatches=N_MB,
            device="cpu",
            timeout=60.0,
            shard_parameters=True,
        )
    )
    return out


def auto_schedule() -> float:
    """The first loss of ``schedule="auto"`` with sharded parameters (its trials run unsharded)."""
    torch.set_num_threads(1)
    inputs, targets = batch_of(0, 0, 2)
    pipe = _pipeline("auto", example_input=inputs[:2])
    part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    return pipe.step(inputs[part], targets[part])


def scaled_against_unsharded_parameters() -> dict[str, Any]:
    """float16 autocast under a GradScaler: 3 steps with parameters sharded, and with the
    optimizer state sharded only (ZeRO-1), from the same blocks and batches."""
    from grad_scaler_workers import build_blocks as float32_blocks
    from grad_scaler_workers import make_batch as float32_batch
    from grad_scaler_workers import scaled_steps
    from twobp.runtime import GradScaler

    torch.set_num_threads(1)
    out = {}
    for sharded in (False, True):
        scaler = GradScaler(init_scale=2.0**8, growth_interval=1)
        pipe = Pipeline(
            float32_blocks(False),
            torch.nn.functional.mse_loss,
            schedule="zb-h1",
            n_microbatches=N_MB,
            two_bp=True,
            device="cpu",
            timeout=60.0,
            autocast=torch.float16,
            data_parallel=2,
            grad_scaler=scaler,
            shard_parameters=sharded,
        )
        optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
        if sharded:
            # Bit for bit with the optimizer sharded alone: one reduce-scatter at R (the
            # shards of one after each W sum in another order).
            assert pipe.state.sharded is not None
            pipe.state.sharded.scatter_each_w = False
        batches = []
        for step in range(N_STEPS):
            x, y = float32_batch(step, PART * 2)
            part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
            batches.append((x[part], y[part]))
        steps = scaled_steps(pipe, scaler, optimizer, batches)
        out[f"sharded={sharded}"] = {**steps, "state": pipe.state_dict()}
        pipe.close()
    return out


def checkpoint_round_trip(folder: str) -> dict[str, Any]:
    """Save after 2 steps with sharded parameters; step 3 there, and after loading into a
    sharded pipeline of another schedule and into an unsharded one."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    def one_step(pipe: Pipeline, optimizer: torch.optim.Optimizer, step: int) -> float:
        inputs, targets = batch_of(step, 0, 2)  # one global batch, whatever the copies
        size = len(inputs) // pipe.dp_size
        part = slice(pipe.dp_rank * size, (pipe.dp_rank + 1) * size)
        loss = pipe.step(inputs[part], targets[part])
        optimizer.step()
        optimizer.zero_grad()
        return loss

    pipe = _pipeline("zb-h1")
    optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
    for step in range(2):
        one_step(pipe, optimizer, step)
    pipe.save(folder, optimizer)
    out["saved"] = (one_step(pipe, optimizer, 2), pipe.state_dict())
    pipe.close()
    other = _pipeline("1f1b")
    optimizer = other.shard_optimizer(torch.optim.AdamW, lr=LR)
    other.load(folder, optimizer)
    out["sharded"] = (one_step(other, optimizer, 2), other.state_dict())
    other.close()
    plain = Pipeline(
        build_blocks("mlp"),
        loss_fn("mlp"),
        n_microbatches=N_MB,
        device="cpu",
        timeout=60.0,
        data_parallel=2,
    )
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LR)
    plain.load(folder, optimizer)
    plain.save(folder, optimizer)  # and back: an unsharded checkpoint, at step 2 still
    out["unsharded"] = (one_step(plain, optimizer, 2), plain.state_dict())
    plain.close()
    copies = _pipeline("1f1b", data_parallel=4, partition=[10])
    optimizer = copies.shard_optimizer(torch.optim.AdamW, lr=LR)
    copies.load(folder, optimizer)
    out["4 copies"] = (one_step(copies, optimizer, 2), copies.state_dict())
    return out


def failed_step() -> tuple[str, float, float, bool]:
    """A step whose loss raises on one rank, then the same batch again: the error (or the
    peers'), the loss of the step after it and of a fresh pipeline's first step, and whether
    any full weight is left gathered."""
    torch.set_num_threads(1)
    failing = [torch.distributed.get_rank() == 1]

    def loss(output: Any, target: Any) -> Any:
        if failing[0]:
            failing[0] = False
            raise ValueError("a loss that fails once")
        return loss_fn("mlp")(output, target)

    inputs, targets = batch_of(0, 0, 2)
    pipe = Pipeline(
        build_blocks("mlp"),
        loss,
        schedule="zb-h1",
        n_microbatches=N_MB,
        two_bp=True,
        device="cpu",
        timeout=60.0,
        data_parallel=2,
        shard_parameters=True,
    )
    part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    try:
        pipe.step(inputs[part], targets[part])
        error = ""
    except Exception as exc:
        error = type(exc).__name__
    again = pipe.step(inputs[part], targets[part])
    held = any(p.untyped_storage().nbytes() for p in pipe.state.parameters())
    pipe.close()
    fresh = _pipeline("zb-h1")
    return error, again, fresh.step(inputs[part], targets[part]), held


def freed_peaks(schedules: list[str], rows: int) -> dict[str, Any]:
    """Per schedule, one step with each stage's gathered weights freed before its W (as
    twobp runs) and one with them kept through its last W (the residency's
    ``free_before_w`` set False), ``recompute="activations"``, ``rows`` rows a copy:
    each run's ``memory_stats`` peaks and the schedule the pipeline ran."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    inputs, targets = make_batch("mlp", 0, 2 * rows)
    for schedule in schedules:
        runs = {}
        for free_before_w in (True, False):
            pipe = _pipeline(schedule, recompute="activations")
            optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
            assert pipe.state.sharded is not None
            pipe.state.sharded.free_before_w = free_before_w
            part = slice(pipe.dp_rank * rows, (pipe.dp_rank + 1) * rows)
            for _ in range(2):  # the first step watches the forwards' saved tensors
                pipe.step(inputs[part], targets[part])
            stats = pipe.memory_stats(optimizer)
            runs[free_before_w] = (stats["peak_freed_before_w"], stats["peak_freed_after_w"])
            compute = pipe.schedule
            pipe.close()
        out[schedule] = {"runs": runs, "schedule": compute}
    return out


def dropout_against_unsharded(modes: list[str | None]) -> dict[str, Any]:
    """An MLP with dropout, 3 AdamW steps from one seed per rank, with parameters sharded
    and with the optimizer state sharded alone, for each recompute mode: losses and
    parameters (a recomputed forward replays the dropout masks of its first run)."""
    import torch.nn.functional as F

    from recompute_workers import dropout_batch, dropout_blocks

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    inputs, targets = dropout_batch(2 * PART)
    for mode in modes:
        for sharded in (False, True):
            pipe = Pipeline(
                dropout_blocks(),
                F.mse_loss,
                schedule="zb-h1",
                n_microbatches=N_MB,
                two_bp=True,
                device="cpu",
                timeout=60.0,
                data_parallel=2,
                shard_parameters=sharded,
                recompute=mode,
            )
            optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
            if sharded:
                assert pipe.state.sharded is not None
                pipe.state.sharded.scatter_each_w = False  # one sum at R, as unsharded
            torch.manual_seed(1000 + pipe.rank)
            part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
            losses = []
            for _ in range(N_STEPS):
                losses.append(pipe.step(inputs[part], targets[part]))
                optimizer.step()
                optimizer.zero_grad()
            out[f"{mode} sharded={sharded}"] = {"losses": losses, "state": pipe.state_dict()}
            pipe.close()
    return out


def compiled_against_eager() -> dict[str, Any]:
    """3 AdamW steps with parameters sharded, each stage compiled (``compile=True``) and
    eager: losses, parameters, and the warnings the compiled steps raised."""
    import warnings

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for compiled in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = _pipeline("zb-h1", compile=compiled)
            optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
            losses = []
            for step in range(N_STEPS):
                inputs, targets = batch_of(step, 0, 2)
                part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
                losses.append(pipe.step(inputs[part], targets[part]))
                optimizer.step()
                optimizer.zero_grad()
            state = pipe.state_dict()
            pipe.close()
        messages = [str(w.message) for w in caught if "compiled" in str(w.message)]
        out[f"compiled={compiled}"] = {"losses": losses, "state": state, "warnings": messages}
    return out
