"""Functions the replicated-stage tests run on every rank of a launched group."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from handoff import Handoff
from runtime_models import LR, N_STEPS, build_blocks, loss_fn, make_batch
from twobp.runtime import Pipeline

N_MB = 4
PART = 8  # samples per data-parallel copy


def _pipeline(
    model: str,
    schedule: str,
    two_bp: bool,
    blocks: list[torch.nn.Module] | None = None,
    **options: Any,
) -> Pipeline:
    return Pipeline(
        build_blocks(model) if blocks is None else blocks,
        loss_fn(model),
        schedule=schedule,
        n_microbatches=options.pop("n_microbatches", N_MB),
        two_bp=two_bp,
        device="cpu",
        timeout=30.0,
        **options,
    )


def train(model: str, schedule: str, two_bp: bool, **options: Any) -> dict[str, Any]:
    """3 AdamW steps; each copy passes its own part of the global batch."""
    torch.set_num_threads(1)
    shape = options.pop("mesh_shape", None)
    if shape is not None:
        options["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp"))
    blocks = build_blocks(model)
    pipe = _pipeline(model, schedule, two_bp, blocks, **options)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, grads, norms = [], {}, []
    for step in range(N_STEPS):
        inputs, targets = make_batch(model, step, PART * pipe.dp_size)
        part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
        inputs = tuple(t[part] for t in inputs) if isinstance(inputs, tuple) else inputs[part]
        losses.append(pipe.step(inputs, targets[part]))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            norms.append(float(pipe.clip_grad_norm_(1e9)))
        optimizer.step()
        pipe.zero_grad()
    inputs, _ = make_batch(model, 0, PART * pipe.dp_size)
    part = slice(pipe.dp_rank * PART, (pipe.dp_rank + 1) * PART)
    inputs = tuple(t[part] for t in inputs) if isinstance(inputs, tuple) else inputs[part]
    for block in blocks:  # BatchNorm normalises by its running statistics
        block.eval()
    outputs = pipe.eval_step(inputs)
    return {
        "outputs": outputs,
        "ends": (pipe.needs_inputs, pipe.needs_targets),
        "losses": losses,
        "grads": grads,
        "norm": norms[0],
        "state": pipe.state_dict(),
        "names": [n for n, _ in pipe.named_parameters()],
        "dp": (pipe.dp_rank, pipe.dp_size, pipe.pp_rank),
        "schedule": str(pipe.lowered_schedule),
    }


def train_many(cases: list[tuple[str, str, bool, dict[str, Any]]]) -> dict[str, Any]:
    """:func:`train` of every case, keyed by its text."""
    return {repr(c): train(c[0], c[1], c[2], **dict(c[3])) for c in cases}


def errors(cases: list[dict[str, Any]]) -> list[str]:
    """The error each set of options raises, as ``type: message``."""
    out = []
    for options in cases:
        options = dict(options)
        mesh_names = options.pop("mesh_names", None)
        if mesh_names is not None:
            options["mesh"] = init_device_mesh("cpu", (1, 2), mesh_dim_names=mesh_names)
        try:
            _pipeline("mlp", options.pop("schedule", "1f1b"), True, **options)
            out.append("no error")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def unequal_parts() -> str:
    """Copies passing batches of different sizes: what every rank's step says (the values
    of such steps are checked against one process in test_runtime_shapes)."""
    torch.set_num_threads(1)
    pipe = _pipeline("mlp", "1f1b", True, data_parallel=2)
    size = PART if pipe.dp_rank == 0 else 2 * PART
    inputs, targets = make_batch("mlp", 0, size)
    try:
        loss = pipe.step(inputs, targets)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"loss {loss!r}"


def save_and_load(folder: str) -> dict[str, Any]:
    """Train a tied 2 x 2 pipeline one step and save it."""
    torch.set_num_threads(1)
    pipe = _pipeline("tied", "1f1b", True, data_parallel=2)
    inputs, targets = make_batch("tied", 0, PART)
    pipe.step(inputs, targets)
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()
    path = pipe.save(folder)
    return {"state": pipe.state_dict(), "path": str(path)}


def adamw_across_copies(folder: str) -> dict[str, torch.Tensor]:
    """2 AdamW steps of the MLP in 2 copies of 2 ranks, a checkpoint; then one pipeline
    over all 4 ranks loads it and takes the third step. Its state on this rank."""
    torch.set_num_threads(1)
    copies = _pipeline("mlp", "1f1b", True, data_parallel=2)
    optimizer = torch.optim.AdamW(copies.parameters(), lr=LR)
    part = slice(copies.dp_rank * PART, (copies.dp_rank + 1) * PART)
    for step in range(2):
        inputs, targets = make_batch("mlp", step, 2 * PART)
        copies.step(inputs[part], targets[part])
        optimizer.step()
        copies.zero_grad()
    copies.save(folder, optimizer)
    copies.close()
    one = _pipeline("mlp", "1f1b", True, n_microbatches=2 * N_MB)
    optimizer = torch.optim.AdamW(one.parameters(), lr=LR)
    one.load(folder, optimizer)
    inputs, targets = make_batch("mlp", 2, 2 * PART)
    one.step(inputs, targets)
    optimizer.step()
    return one.state_dict()


def load_tied(folder: str) -> dict[str, Any]:
    """Load a checkpoint into one tied pipeline over all the ranks."""
    torch.set_num_threads(1)
    pipe = _pipeline("tied", "1f1b", True)
    pipe.load(folder)
    return {"state": pipe.state_dict()}


def groups_around_a_pipeline() -> tuple[int, int, int, float, float]:
    """Process groups alive before a tied pipeline, once built and stepped, and once a
    second pipeline is built on the same blocks after its close; the two losses."""
    torch.set_num_threads(1)
    groups = torch.distributed.distributed_c10d._world.pg_map
    before = len(groups)
    blocks = build_blocks("tied")
    inputs, targets = make_batch("tied", 0, PART)
    with Pipeline(blocks, loss_fn("tied"), "1f1b", n_microbatches=N_MB, timeout=30.0) as first:
        first_loss = first.step(inputs, targets)
        built = len(groups)
    with Pipeline(blocks, loss_fn("tied"), "1f1b", n_microbatches=N_MB, timeout=30.0) as second:
        return before, built, len(groups), first_loss, second.step(inputs, targets)


POSTED = "rank 0 ran 0W0-1"
"""The point rank 1 waits for in :func:`late_reduction` before its last ``W``."""
LATE = "rank 1 runs 1W1"
"""The point rank 1 reaches once it goes on."""


def late_reduction(folder: str) -> dict[str, Any]:
    """Chimera with 2BP on 2 ranks, where rank 1 is late for its last ``R``; one step.

    Rank 0 runs ``... 3W2-3 3R2-3 0W0-1 0R0-1``; the replica of its stage 3 is rank
    1's stage 1, whose ``1W1 1R0-1`` end rank 1's step. Rank 1 starts ``1W1`` (after
    its last transfer to rank 0) only once rank 0 has run ``0W0-1``: rank 0 must
    have gone past ``3R2-3`` without the all-reduce, which cannot complete before
    rank 1's ``R``. Returns what each rank saw of the other (see :mod:`handoff`) and
    the gradients.
    """
    torch.set_num_threads(1)
    # Below the pipeline's timeout: a rank 0 that waits in 3R2-3 is reported by rank 1.
    handoff = Handoff(folder, limit=20.0)
    pipe = _pipeline("mlp", "chimera", True)
    seen: dict[str, Any] = {}
    stage = pipe.stages[0 if pipe.pp_rank == 0 else 1]
    weight = stage.weight

    def rank_0_weight(mbs: Any, weight_group_size: int | None, **options: Any) -> None:
        weight(mbs, weight_group_size, **options)
        if list(mbs) == [0, 1]:
            handoff.reach(POSTED)

    def rank_1_weight(mbs: Any, weight_group_size: int | None, **options: Any) -> None:
        if list(mbs) == [1]:
            try:
                handoff.wait_for(POSTED)
                seen["waited for"] = POSTED
            except AssertionError as exc:
                seen["waited for"] = str(exc)
            handoff.reach(LATE)
        weight(mbs, weight_group_size, **options)

    late_weight = rank_0_weight if pipe.pp_rank == 0 else rank_1_weight
    stage.weight = late_weight  # type: ignore[method-assign]
    inputs, targets = make_batch("mlp", 0, PART)
    pipe.step(inputs, targets)
    # Rank 0's step ended once its reductions did: after rank 1 went on.
    seen["late rank at the end"] = handoff.reached(LATE)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    return {"seen": seen, "grads": grads}
