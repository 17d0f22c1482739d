"""Functions the sharded-optimizer tests run on every rank of a launched group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from handoff import Handoff
from runtime_models import LR, N_STEPS, build_blocks, loss_fn, make_batch
from twobp.runtime import Pipeline, PipelineConfigError
from twobp.runtime.execution.memory import storages

N_MB = 4
PART = 8  # samples per data-parallel copy
CLIP = 0.05  # small enough that every step clips


def _pipeline(model: str, schedule: str, two_bp: bool, **options: Any) -> Pipeline:
    return Pipeline(
        build_blocks(model),
        loss_fn(model),
        schedule=schedule,
        n_microbatches=options.pop("n_microbatches", N_MB),
        two_bp=two_bp,
        device="cpu",
        timeout=60.0,
        **options,
    )


def _part(pipe: Pipeline, model: str, step: int) -> tuple[Any, Any]:
    inputs, targets = make_batch(model, step, PART * pipe.dp_size)
    part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    inputs = tuple(t[part] for t in inputs) if isinstance(inputs, tuple) else inputs[part]
    return inputs, targets[part]


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(storages(v for s in optimizer.state.values() for v in s.values()).values())


def train(model: str, schedule: str, two_bp: bool, **options: Any) -> dict[str, Any]:
    """3 clipped AdamW steps through a sharded optimizer, with an LR schedule."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    if schedule == "auto":
        # The limit fits the optimizer state sharded only: without sharding nothing fits.
        try:
            _pipeline(model, schedule, two_bp, **{**options, "optimizer_sharded": False}).close()
        except PipelineConfigError as exc:
            out["refused"] = str(exc)
    pipe = _pipeline(model, schedule, two_bp, **options)
    if pipe.plan is not None:
        out["peak"] = pipe.plan.choice.peak_memory
    # A V without an example input balances on its first step's inputs: plan on them now,
    # to shard the optimizer over the parameters each rank will hold (else nothing happens).
    pipe.plan_on(_part(pipe, model, 0)[0])
    optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    losses, norms = [], []
    for step in range(N_STEPS):
        losses.append(pipe.step(*_part(pipe, model, step)))
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    # The state an unsharded AdamW would hold for this rank's parameters.
    plain = torch.optim.AdamW([nn.Parameter(p.detach().clone()) for p in pipe.parameters()])
    for p in plain.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    plain.step()
    sharded = pipe.state.sharded
    assert sharded is not None
    first_forwards = [
        a.stage for a in pipe.schedule.actions[pipe.pp_rank] if a.kind.name == "FORWARD"
    ]
    return {
        **out,
        "gathers": list(dict.fromkeys(s.bucket.key for s in sharded.gather_order)),
        "forwards": [
            f"stage {pipe.schedule.model_stage(s)}" for s in dict.fromkeys(first_forwards)
        ],
        "losses": losses,
        "norms": norms,
        "state": pipe.state_dict(),
        "optimizer": pipe.memory_stats(optimizer)["optimizer"],
        "own": _state_bytes(optimizer),
        "unsharded": _state_bytes(plain),
        "kind": type(optimizer).__name__,
        "shards": [p.numel() for p in optimizer.param_groups[0]["params"]],
    }


def train_many(cases: list[tuple[str, str, bool, dict[str, Any]]]) -> dict[str, Any]:
    """:func:`train` of every case, keyed by its text."""
    return {repr(c): train(c[0], c[1], c[2], **dict(c[3])) for c in cases}


GLOBAL = 16  # samples per step over all copies, whatever their number


def _global_part(pipe: Pipeline, step: int) -> tuple[Any, Any]:
    inputs, targets = make_batch("mlp", step, GLOBAL)
    size = GLOBAL // pipe.dp_size
    part = slice(pipe.dp_rank * size, (pipe.dp_rank + 1) * size)
    return inputs[part], targets[part]


def _one_step(pipe: Pipeline, optimizer: torch.optim.Optimizer, step: int) -> float:
    loss = pipe.step(*_global_part(pipe, step))
    pipe.clip_grad_norm_(CLIP)
    optimizer.step()
    pipe.zero_grad()
    return loss


def _refused(call: Callable[[], object]) -> str:
    try:
        call()
    except PipelineConfigError as exc:
        return str(exc)
    return "not refused"


def _blocks_wait_for_their_gathers(
    pipe: Pipeline, optimizer: torch.optim.Optimizer, handoff: Handoff
) -> tuple[bool, str]:
    """Step 0, then the first copy runs its stage's blocks while their gathers are in
    flight: the second copy steps its optimizer (its part of every gather) only once the
    first has reached its first block's forward. Each block must wait for its own
    parameters. Returns whether that output equals the one after every gather, and what
    ordered the two copies (``"raced"``, or why not)."""
    pipe.step(*_global_part(pipe, 0))
    pipe.clip_grad_norm_(CLIP)
    ((index, stage),) = pipe.stages.items()
    point = f"copy 0 runs the blocks of stage {index}"
    raced = "raced"
    if pipe.dp_rank == 1:
        try:
            handoff.wait_for(point)
        except AssertionError as exc:
            raced = str(exc)
        optimizer.step()
    else:
        optimizer.step()
        first = next(iter(stage.module.children()))
        # Before the block's own hook, which waits for the gathers.
        reach = first.register_forward_pre_hook(lambda *_: handoff.reach(point), prepend=True)
    x = torch.randn(2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        early = stage.module(x)
        list(pipe.parameters())  # waits for every gather
        late = stage.module(x)
    if pipe.dp_rank == 0:
        reach.remove()
    pipe.zero_grad()
    return bool(torch.equal(early, late)), raced


def checkpoints(folder: str) -> dict[str, Any]:
    """A sharded optimizer saved after 2 steps, loaded into an unsharded optimizer on one
    pipeline of 4 ranks and into sharded ones of other layouts; each runs step 3."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # 2 copies of 2 ranks, sharded: two steps, a checkpoint, the third step.
    pipe = _pipeline("mlp", "1f1b", True, data_parallel=2)
    optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
    handoff = Handoff(folder, limit=30.0)  # below the pipeline's timeout
    out["blocks wait"] = _blocks_wait_for_their_gathers(pipe, optimizer, handoff)
    out["refused"] = _refused(lambda: optimizer.add_param_group({"params": []}))
    out["refused params"] = _refused(
        lambda: pipe.shard_optimizer(torch.optim.AdamW, params=pipe.parameters())
    )
    _one_step(pipe, optimizer, 1)
    pipe.save(f"{folder}/sharded", optimizer)
    out["third"] = _one_step(pipe, optimizer, 2)
    out["state"] = pipe.state_dict()
    pipe.close()
    # One pipeline of 4 ranks, a plain optimizer: loads it, saves it again, runs step 3.
    plain = _pipeline("mlp", "1f1b", True)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=LR)
    plain.load(f"{folder}/sharded", plain_optimizer)
    plain.save(f"{folder}/plain", plain_optimizer)
    out["plain third"] = _one_step(plain, plain_optimizer, 2)
    out["plain state"] = plain.state_dict()
    plain.close()
    # 2 copies of an interleaved pipeline, sharded: loads the plain checkpoint.
    again = _pipeline("mlp", "interleaved-1f1b", True, data_parallel=2)
    again_optimizer = again.shard_optimizer(torch.optim.AdamW, lr=LR)
    again.load(f"{folder}/plain", again_optimizer)
    out["again third"] = _one_step(again, again_optimizer, 2)
    out["again state"] = again.state_dict()
    again.close()
    # 4 copies of one rank, sharded four ways: loads the sharded checkpoint.
    wide = _pipeline("mlp", "1f1b", True, data_parallel=4)
    wide_optimizer = wide.shard_optimizer(torch.optim.AdamW, lr=LR)
    wide.load(f"{folder}/sharded", wide_optimizer)
    out["wide third"] = _one_step(wide, wide_optimizer, 2)
    out["wide state"] = wide.state_dict()
    wide.close()
    out["half"] = _half_precision_masters(folder)
    return out


def _half_step(pipe: Pipeline, optimizer: torch.optim.Optimizer, step: int) -> None:
    inputs, targets = _global_part(pipe, step)
    pipe.step(inputs.bfloat16(), targets.bfloat16())
    pipe.clip_grad_norm_(CLIP)
    optimizer.step()
    pipe.zero_grad()


def _half_pipeline() -> Pipeline:
    blocks = [b.to(torch.bfloat16) for b in build_blocks("mlp")]
    return Pipeline(blocks, loss_fn("mlp"), "1f1b", n_microbatches=2, data_parallel=4, timeout=60.0)


def _half_precision_masters(folder: str) -> dict[str, bool]:
    """bfloat16 parameters, 4 copies of one rank, 2 steps: the optimizer steps float32
    master shards, the gathered parameters are the masters rounded, and a checkpoint
    after the first step resumes the masters themselves."""
    pipe = _half_pipeline()
    optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=LR)
    _half_step(pipe, optimizer, 0)
    pipe.save(f"{folder}/half", optimizer)
    _half_step(pipe, optimizer, 1)
    list(pipe.parameters())  # waits for the gathers
    sharded = pipe.state.sharded
    assert sharded is not None
    masters = [s.master.detach().clone() for s in sharded.shards]
    mine = [s.flat[s.layout.start : s.layout.stop] for s in sharded.shards]
    pipe.close()
    again = _half_pipeline()
    again_optimizer = again.shard_optimizer(torch.optim.AdamW, lr=LR)
    again.load(f"{folder}/half", again_optimizer)
    _half_step(again, again_optimizer, 1)
    assert again.state.sharded is not None
    resumed = [s.master for s in again.state.sharded.shards]
    again.close()
    return {
        "resumed": all(torch.equal(a, b) for a, b in zip(masters, resumed, strict=True)),
        "float32": all(m.dtype == torch.float32 for m in masters),
        "rounded": all(
            torch.equal(m.to(torch.bfloat16), p) for m, p in zip(masters, mine, strict=True)
        ),
        "finer": any(not torch.equal(m, p.float()) for m, p in zip(masters, mine, strict=True)),
    }
