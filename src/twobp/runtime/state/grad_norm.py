"""Gradient clipping by the norm of the whole model, whose parameters span all ranks."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from twobp.runtime.base.group import Membership
from twobp.runtime.communication import collective


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float,
    world: Membership,
    device: torch.device,
    timeout: float,
    counted: Iterable[nn.Parameter] | None = None,
    shards: Iterable[Tensor] = (),
    counted_shards: Iterable[Tensor] | None = None,
) -> Tensor:
    """Scale this rank's gradients so that the global norm is at most ``max_norm``.

    Each rank reduces its local gradients to one number (a sum of p-th powers,
    or a maximum for the infinity norm), the ranks combine them with one
    all-reduce, and every rank applies the same coefficient, computed as
    ``torch.nn.utils.clip_grad_norm_`` does: ``clamp(max_norm / (norm + 1e-6), max=1)``.
    Collective: every rank calls it.

    Args:
        parameters: this rank's parameters; those without a gradient are skipped.
        max_norm: the largest global norm allowed.
        norm_type: the p of the p-norm (``inf`` for the largest absolute value).
        world: the group over which the model is spread.
        device: where the reduction runs (the backend's device).
        timeout: seconds to wait for the other ranks.
        counted: the parameters whose gradients count in the norm here (one
            holder of each replicated parameter); None: all of ``parameters``.
        shards: gradients of a sharded optimizer's shards (each element of a
            replicated parameter is in one rank's shard): clipped, and counted unless
            ``counted_shards`` says which parts count.
        counted_shards: the parts of ``shards`` whose elements count in the norm here
            (with tensor parallelism: a split parameter's on every rank, a parameter
            every tensor-parallel rank holds whole on one of them); None: all of them.

    Returns:
        The global norm before clipping, a 0-dim tensor.
    """
    params = list(parameters)
    extra = list(shards)
    grads = [p.grad for p in params if p.grad is not None] + extra
    extra = extra if counted_shards is None else list(counted_shards)
    mine = grads if counted is None else [p.grad for p in counted if p.grad is not None] + extra
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        local = max((float(g.detach().abs().max()) for g in mine), default=0.0)
        total = collective.scalar(local, device)
        collective.all_reduce(world, total, dist.ReduceOp.MAX, timeout, "the gradient norm")
    else:
        powers = [
            torch.linalg.vector_norm(g.detach(), norm_type).double() ** norm_type for g in mine
        ]
        total = collective.scalar(float(torch.stack(powers).sum()) if powers else 0.0, device)
        collective.all_reduce(world, total, dist.ReduceOp.SUM, timeout, "the gradient norm")
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total.to(grads[0].dtype) if grads else total
