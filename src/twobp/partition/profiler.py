"""Measure what each block of a model costs: F, I and W time, and the memory it keeps.

Each block runs on its own, in order, on the device its parameters live on,
with the output of the previous block as input (one real micro-batch). Under
the 2BP engine (``defer_weight_grads``) a block's forward, its input pass (I)
and its weight pass (W) are timed separately, a few times each, and the
median is kept. The plain autograd backward (B, I and W fused) is timed too,
so that a simulation can compare 2BP with an ordinary schedule.

Memory per micro-batch is read, not estimated: the bytes of tensors autograd
saves for the backward (parameters excluded), the bytes the engine stashes
from I until W, and the bytes of the block's output (what crosses a stage
boundary).

Profiling leaves the blocks as it found them: parameter gradients and buffers
(BatchNorm running statistics) are restored afterwards.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from twobp.engine import WeightGradStore, defer_weight_grads

Activation = torch.Tensor | tuple[torch.Tensor, ...]
"""What a block takes and returns: a tensor or a tuple of tensors."""


@dataclass(frozen=True)
class BlockCost:
    """Measured costs of one block for one micro-batch.

    Times are medians in seconds; sizes are bytes.
    """

    index: int
    """Position of the block in the model."""
    name: str
    """The block's class name."""
    forward: float
    """Time of the forward (F)."""
    backward_input: float
    """Time of the input pass (I, backward-p1) under the 2BP engine."""
    backward_weight: float
    """Time of the weight pass (W, backward-p2) of this one micro-batch."""
    backward_full: float
    """Time of a plain autograd backward (B: I and W fused), without the engine."""
    activation_bytes: int
    """Bytes saved for the backward during F (parameters excluded), freed by I."""
    weight_grad_bytes: int
    """Bytes the engine keeps from I until W."""
    output_bytes: int
    """Bytes of the block's output: what a stage boundary after it sends."""
    parameter_bytes: int
    """Bytes of the block's parameters."""
    forward_full: float | None = None
    """Time of the forward without the 2BP engine, as a stage whose backward is
    fused (``B``) runs it; None where not measured."""

    @property
    def total(self) -> float:
        """``forward + backward_input + backward_weight``: the cost the solver balances."""
        return self.forward + self.backward_input + self.backward_weight


def profile_blocks(
    blocks: Sequence[nn.Module],
    example_input: Activation,
    *,
    repeats: int = 5,
    warmup: int = 1,
) -> list[BlockCost]:
    """Time and size every block on one micro-batch.

    Args:
        blocks: the model's blocks, in order; each runs where its parameters are.
        example_input: one micro-batch for the first block (on its device).
        repeats: timed runs per block; the median is kept.
        warmup: untimed runs first (kernel selection, allocator, caches).

    Returns:
        One :class:`BlockCost` per block, in order.

    Raises:
        ValueError: if ``repeats < 1`` or ``warmup < 0``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    costs: list[BlockCost] = []
    x = example_input
    for index, block in enumerate(blocks):
        with restored(block):
            cost, x = _profile_one(index, block, x, repeats, warmup)
        costs.append(cost)
    return costs


def _profile_one(
    index: int, block: nn.Module, x: Activation, repeats: int, warmup: int
) -> tuple[BlockCost, Activation]:
    inputs = _as_leaves(x)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    sync = synchronizer(inputs + [p for p in block.parameters()])
    grad_out: list[torch.Tensor] = []
    times: dict[str, list[float]] = {"F": [], "I": [], "W": [], "B": [], "f": []}
    saved = stashed = 0

    for run in range(warmup + repeats):
        begin = sync()
        out = _outputs(block(_call_form(x, inputs)))
        start = sync()
        grad_out = grad_out or [_gradient_like(o) for o in out]
        torch.autograd.backward(_needing_grad(out), _needing_grad(out, grad_out))
        if run >= warmup:
            times["f"].append(start - begin)
            times["B"].append(sync() - start)

    store = defer_weight_grads(block, label=f"block {index}")
    try:
        for run in range(warmup + repeats):
            start = sync()
            with store.forward(0), _saved_bytes(params) as held:
                out = _outputs(block(_call_form(x, inputs)))
            mid = sync()
            store.backward_input(0, out, grad_out, inputs)
            end_input = sync()
            stashed = store.stashed_bytes().get(0, 0)
            store.backward_weight([0])
            end = sync()
            store.finish_step()
            saved = held()
            if run >= warmup:
                times["F"].append(mid - start)
                times["I"].append(end_input - mid)
                times["W"].append(end - end_input)
    finally:
        store.restore()

    with torch.no_grad():
        result = block(_call_form(x, [t.detach() for t in inputs]))
    cost = BlockCost(
        index=index,
        name=type(block).__name__,
        forward=statistics.median(times["F"]),
        backward_input=statistics.median(times["I"]),
        backward_weight=statistics.median(times["W"]),
        backward_full=statistics.median(times["B"]),
        activation_bytes=saved,
        weight_grad_bytes=stashed,
        output_bytes=sum(o.numel() * o.element_size() for o in _outputs(result)),
        parameter_bytes=sum(p.numel() * p.element_size() for p in block.parameters()),
        forward_full=statistics.median(times["f"]),
    )
    return cost, result


def weight_group_times(
    blocks: Sequence[nn.Module],
    example_input: Activation,
    counts: Sequence[int],
    *,
    repeats: int = 1,
    warmup: int = 1,
) -> list[dict[int, float]]:
    """Time one W concatenated over ``k`` micro-batches, for every ``k`` of ``counts``.

    A concatenated W is cheaper than ``k`` single ones (fewer, larger
    products), by how much depends on the layer sizes and the device; this
    is the table (``weight_concat``) by which the simulator and the 2BP
    placement cost a grouped W. Each block runs the F and I of ``k`` copies
    of its input (untimed), then one W over all of them (timed).

    Args:
        blocks: the model's blocks, in order; each runs where its parameters are.
        example_input: one micro-batch for the first block (on its device).
        counts: the group sizes to time (each >= 1).
        repeats: timed runs per size; the median is kept.
        warmup: untimed runs per size first (the first W of a store pays set-up).

    Returns:
        Per block, ``{k: seconds}``.

    Raises:
        ValueError: if a count or ``repeats`` is below 1, or ``warmup`` below 0.
    """
    if repeats < 1 or warmup < 0 or any(k < 1 for k in counts):
        raise ValueError(
            f"need counts >= 1, repeats >= 1 and warmup >= 0, got {list(counts)}, {repeats} "
            f"and {warmup}"
        )
    tables: list[dict[int, float]] = []
    x = example_input
    for index, block in enumerate(blocks):
        with restored(block):
            store = defer_weight_grads(block, label=f"block {index}")
            try:
                table = {
                    k: _median_group_time(store, block, x, k, warmup, repeats)
                    for k in sorted(set(counts))
                }
            finally:
                store.restore()
            # A training-mode forward updates BatchNorm's running statistics too.
            with torch.no_grad():
                x = block(_call_form(x, [t.detach() for t in _as_leaves(x)]))
        tables.append(table)
    return tables


def _median_group_time(
    store: WeightGradStore, block: nn.Module, x: Activation, k: int, warmup: int, repeats: int
) -> float:
    for _ in range(warmup):
        _grouped_weight_time(store, block, x, k)
    return statistics.median(_grouped_weight_time(store, block, x, k) for _ in range(repeats))


def _grouped_weight_time(store: WeightGradStore, block: nn.Module, x: Activation, k: int) -> float:
    """Seconds of one W over ``k`` micro-batches of ``x`` (their F and I untimed)."""
    inputs = _as_leaves(x)
    sync = synchronizer(inputs + [p for p in block.parameters()])
    for mb in range(k):
        leaves = _as_leaves(x)
        with store.forward(mb):
            out = _outputs(block(_call_form(x, leaves)))
        store.backward_input(mb, out, [_gradient_like(o) for o in out], leaves)
    start = sync()
    store.backward_weight(range(k))
    seconds = sync() - start
    store.finish_step()
    return seconds


def solver_costs(costs: Sequence[BlockCost]) -> list[float]:
    """Per-block ``F + I + W`` time, the ``costs`` argument of :func:`~twobp.partition.solve`."""
    return [c.total for c in costs]


def solver_memory(
    costs: Sequence[BlockCost], in_flight: int, *, parameter_factor: float = 4.0
) -> list[float]:
    """Per-block memory estimate, the ``memory`` argument of :func:`~twobp.partition.solve`.

    Args:
        costs: the measured blocks.
        in_flight: micro-batches whose activations a stage holds at its peak
            (for 1F1B, the number of stages for the first stage).
        parameter_factor: bytes kept per parameter byte: weights, gradients and
            optimiser state (4 for AdamW in the parameter dtype).

    Returns:
        ``parameter_factor * parameters + in_flight * (activations + W stash)`` per block.
    """
    return [
        parameter_factor * c.parameter_bytes
        + in_flight * (c.activation_bytes + c.weight_grad_bytes)
        for c in costs
    ]


# -- helpers -------------------------------------------------------------------


def _as_leaves(x: Activation) -> list[torch.Tensor]:
    """Fresh leaf copies of the block input, requiring grad where floating."""
    tensors = list(x) if isinstance(x, tuple) else [x]
    return [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]


def _call_form(x: Activation, leaves: list[torch.Tensor]) -> Activation:
    return tuple(leaves) if isinstance(x, tuple) else leaves[0]


def _outputs(out: Activation) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def _gradient_like(out: torch.Tensor) -> torch.Tensor:
    """A random output gradient; zeros for outputs that take none (masks, ids)."""
    return torch.randn_like(out) if out.is_floating_point() else torch.zeros_like(out)


def _needing_grad(
    out: list[torch.Tensor], values: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """``values`` (default ``out``) at the outputs that carry a gradient."""
    chosen = out if values is None else values
    return [v for o, v in zip(out, chosen, strict=True) if o.requires_grad]


def synchronizer(tensors: Sequence[torch.Tensor]) -> Callable[[], float]:
    """A clock that first waits for the device's queued work (CUDA runs asynchronously)."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}

    def now() -> float:
        for device in devices:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


@contextmanager
def _saved_bytes(exclude: set[int]) -> Iterator[Callable[[], int]]:
    """Count the bytes autograd saves for backward inside the block (storages once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield lambda: sum(storages.values())


@contextmanager
def restored(block: nn.Module) -> Iterator[None]:
    """Run with the block's gradients cleared, and put back its gradients and buffers after.

    Whatever runs inside may accumulate gradients and, in training mode,
    update buffers (BatchNorm's running statistics); the block leaves as it came.
    """
    grads = {p: p.grad for p in block.parameters()}
    buffers = {name: b.clone() for name, b in block.named_buffers()}
    for p in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for name, b in block.named_buffers():
                b.copy_(buffers[name])
