"""Functions the replicated-stage tests run on every rank of a launched group."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

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
    """Copies passing batches of different sizes: the error every rank raises."""
    torch.set_num_threads(1)
    pipe = _pipeline("mlp", "1f1b", True, data_parallel=2)
    size = PART if pipe.dp_rank == 0 else 2 * PART
    inputs, targets = make_batch("mlp", 0, size)
    try:
        pipe.step(inputs, targets)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def save_and_load(folder: str) -> dict[str, Any]:
    """Train a tied 2 x 2 pipeline one step and save it."""
    torch.set_num_threads(1)
    pipe = _pipeline("tied", "1f1b", True, data_parallel=2)
    inputs, targets = make_batch("tied", 0, PART)
    pipe.step(inputs, targets)
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()
    path = pipe.save(folder)
    return {"state": pipe.state_dict(), "path": str(path)}


def load_tied(folder: str) -> dict[str, Any]:
    """Load a checkpoint into one tied pipeline over all the ranks."""
    torch.set_num_threads(1)
    pipe = _pipeline("tied", "1f1b", True)
    pipe.load(folder)
    return {"state": pipe.state_dict()}


def groups_around_a_pipeline() -> tuple[int, int, int, float]:
    """Process groups alive before a tied pipeline, once built and stepped, and once a
    second pipeline is built on the same blocks after its close; the second's loss."""
    torch.set_num_threads(1)
    groups = torch.distributed.distributed_c10d._world.pg_map
    before = len(groups)
    blocks = build_blocks("tied")
    inputs, targets = make_batch("tied", 0, PART)
    with Pipeline(blocks, loss_fn("tied"), "1f1b", n_microbatches=N_MB, timeout=30.0) as first:
        first.step(inputs, targets)
        built = len(groups)
    with Pipeline(blocks, loss_fn("tied"), "1f1b", n_microbatches=N_MB, timeout=30.0) as second:
        return before, built, len(groups), second.step(inputs, targets)
