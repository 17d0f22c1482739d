"""Cross-entropy on logits split by vocabulary, as Megatron's ``vocab_parallel_cross_entropy``.

A column-parallel head whose logits are not gathered (style ``"colwise_loss_parallel"``)
leaves each rank of the tensor-parallel group ``V / T`` columns of the logits: those of
vocabulary ids ``rank * V / T ... (rank + 1) * V / T - 1``. The loss is computed on these
shards, so that no rank holds ``[tokens, V]`` whole::

    m   = all_reduce_max(max_j z_j)                    (the logits' max, for stability)
    s   = all_reduce_sum(sum_j exp(z_j - m))           (the softmax's denominator)
    z_t = all_reduce_sum(z_t - m on the rank holding t, 0 elsewhere)
    loss = log(s) - z_t

and the backward gives each rank the gradient of its own columns only: its shard of the
softmax, minus one at the target on the rank that holds it. With label smoothing ``e`` the
target is ``1 - e`` on the true id and ``e / V`` on every id, as in ``F.cross_entropy``:
``loss = log(s) - (1 - e) z_t - e mean_j (z_j - m)``, the mean's sum all-reduced with
``z_t`` (still three all-reduces), and the gradient less ``e / V`` in every column. Class
weights ``w`` (given whole on every rank) weigh the target's term by ``w_t`` and the
smoothing's mean by each ``w_j``; ``"mean"`` divides by the targets' weights, as
``F.cross_entropy`` does.

:func:`loss_parallel` lets a loss written for whole logits run on the shards, as torchtitan's
``loss_parallel()`` does for DTensor: inside it, ``F.cross_entropy`` of the head's shard (after
reshapes of the leading dims, dtype casts, indexing of the leading dims) is this
cross-entropy; any other operation on the shard is refused, since it would silently see a
part of the vocabulary.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MARK = "_twobp_vocab_shard"
"""The attribute a shard of the logits carries: its :class:`VocabShard`."""


@dataclass(frozen=True)
class VocabShard:
    """What a tensor of logits split by vocabulary is a shard of.

    Args:
        vocab: the whole vocabulary ``V``.
        group: the tensor-parallel process group the columns are split over.
    """

    vocab: int
    group: Any


def mark_shard(logits: torch.Tensor, vocab: int, group: Any) -> torch.Tensor:
    """Mark ``logits`` (a column-parallel head's output) as this rank's columns of ``vocab``."""
    setattr(logits, _MARK, VocabShard(vocab, group))
    return logits


def shard_of(tensor: Any) -> VocabShard | None:
    """The :class:`VocabShard` ``tensor`` is marked with, or None."""
    return getattr(tensor, _MARK, None) if isinstance(tensor, torch.Tensor) else None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: Any,
        ignore_index: int,
        smoothing: float,
        weight: torch.Tensor | None,
        of_target: torch.Tensor | None,
    ) -> torch.Tensor:
        local = logits.shape[-1]
        start = dist.get_rank(group) * local
        vocab = local * dist.get_world_size(group)
        ignored = targets == ignore_index
        peak = logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        index = targets - start
        owned = (index >= 0) & (index < local)
        index = index.masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~owned, 0.0)
        # The class weights are given whole (each target's, ``of_target``, and their sum
        # need no communication); this rank's columns weigh its logits.
        mine = None if weight is None else weight[start : start + local]
        weights_sum = float(vocab) if weight is None else weight.sum()
        every = None
        if smoothing:
            # One all-reduce for both sums: the target's logit and every (weighted) logit's.
            every = shifted.sum(dim=-1) if mine is None else shifted @ mine
            sums = torch.stack([target_logit, every])
            dist.all_reduce(sums, group=group)
            target_logit, every = sums[0], sums[1]
        else:
            dist.all_reduce(target_logit, group=group)
        softmax = shifted.exp_()
        total = softmax.sum(dim=-1)
        dist.all_reduce(total, group=group)
        softmax.div_(total.unsqueeze(-1))
        log_total = total.log()
        loss = log_total - target_logit
        if of_target is not None:
            loss = loss * of_target
        if smoothing:
            assert every is not None
            loss = (1.0 - smoothing) * loss + smoothing / vocab * (weights_sum * log_total - every)
        ctx.save_for_backward(softmax, index, owned, ignored, of_target, mine)
        ctx.smoothing, ctx.vocab, ctx.weights_sum = smoothing, vocab, weights_sum
        return loss.masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, index, owned, ignored, of_target, mine = ctx.saved_tensors
        smoothing, vocab = ctx.smoothing, ctx.vocab
        scale = grad.masked_fill(ignored, 0.0)
        # d loss / d z_k = (1 - e) w_t (p_k - [k = t]) + e / V (sum_j w_j p_k - w_k)
        at_target = (1.0 - smoothing) * scale
        if of_target is not None:
            at_target = at_target * of_target
        of_softmax = at_target
        if smoothing:
            of_softmax = at_target + (smoothing / vocab) * ctx.weights_sum * scale
        out = softmax * of_softmax.unsqueeze(-1)
        if smoothing:
            uniform = (smoothing / vocab) * scale.unsqueeze(-1)
            out -= uniform if mine is None else uniform * mine
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, index] -= owned.to(out.dtype) * at_target
        return out, None, None, None, None, None, None


REDUCTIONS = ("mean", "sum", "none")


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    group: Any,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` of logits split by vocabulary over ``group``, on the shards.

    Collective over ``group``: three all-reduces of ``[tokens]`` (a max and two sums; with
    label smoothing one of the sums is of ``[2, tokens]``), none of ``[tokens, V]``. Every
    rank returns the same loss; the backward gives each rank the gradient of its own columns.

    Args:
        logits_shard: ``[..., V / T]``, this rank's columns of the logits (rank ``r`` holds
            ids ``r * V / T`` up to ``(r + 1) * V / T - 1``, as a ``"colwise"`` split cuts).
        targets: ``[...]`` integer ids in ``[0, V)`` (or ``ignore_index``), the leading dims
            of ``logits_shard``.
        group: the tensor-parallel process group (None: the default group).
        ignore_index: a target that counts neither in the loss nor in the mean.
        reduction: ``"mean"`` over the targets not ignored, ``"sum"`` or ``"none"``
            (the loss of every target, ``[...]``; 0 where ignored).
        label_smoothing: in ``[0, 1]``, as ``F.cross_entropy``'s: the target mixes one-hot
            (weight ``1 - label_smoothing``) with the uniform distribution over the whole
            vocabulary.
        weight: ``[V]``, a weight for each id of the whole vocabulary, as
            ``F.cross_entropy``'s (the same on every rank; ``"mean"`` divides by the
            targets' weights); it gets no gradient.

    Returns:
        The loss, as ``F.cross_entropy`` of the whole logits gives it.

    Raises:
        ValueError: a reduction other than these, a label smoothing outside ``[0, 1]``,
            targets that are not integers or whose shape is not the logits' leading dims,
            a weight that is not ``[V]`` or requires grad.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"vocab_parallel_cross_entropy: reduction={reduction!r}; choose one of {REDUCTIONS}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(
            f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing!r}; give a "
            "number between 0.0 and 1.0"
        )
    if targets.is_floating_point() or targets.shape != logits_shard.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: targets {tuple(targets.shape)} {targets.dtype} do "
            f"not fit logits {tuple(logits_shard.shape)}: give integer ids of shape "
            "logits.shape[:-1]"
        )
    flat = targets.reshape(-1)
    counted = flat != ignore_index
    of_targets = None  # each target's class weight, 0 where ignored
    if weight is not None:
        weight = _class_weights(weight, logits_shard, group)
        of_targets = weight[flat.masked_fill(~counted, 0)].masked_fill(~counted, 0.0)
    losses = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        logits_shard.reshape(-1, logits_shard.shape[-1]),
        flat,
        group,
        ignore_index,
        float(label_smoothing),
        weight,
        of_targets,
    )
    if reduction == "none":
        return losses.reshape(targets.shape)  # type: ignore[no-any-return]
    if reduction == "sum":
        return losses.sum()  # type: ignore[no-any-return]
    counts = counted.sum() if of_targets is None else of_targets.sum()
    return losses.sum() / counts  # type: ignore[no-any-return]


def _class_weights(weight: torch.Tensor, logits_shard: torch.Tensor, group: Any) -> torch.Tensor:
    """``weight`` checked to be one per id of the whole vocabulary, in the logits' dtype."""
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "vocab_parallel_cross_entropy: the class weights require grad, which it does not "
            "compute; pass weight.detach()"
        )
    vocab = logits_shard.shape[-1] * dist.get_world_size(group)
    if weight.shape != (vocab,) or not weight.is_floating_point():
        raise ValueError(
            f"vocab_parallel_cross_entropy: weight {tuple(weight.shape)} {weight.dtype}: give "
            f"one floating-point weight per id of the whole vocabulary, shape ({vocab},)"
        )
    return weight.to(logits_shard.dtype)


_KEEP = frozenset({"float", "double", "half", "bfloat16", "to", "type", "contiguous"})
"""Operations that keep every column of a shard as it is (casts)."""
_METADATA = frozenset(
    {"__get__", "size", "dim", "ndimension", "element_size", "numel", "nelement"}
    | {"is_floating_point", "is_contiguous", "get_device", "__len__"}
)
"""Questions about a shard that answer without its values (``.shape``, ``.dtype``)."""
_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


class _LossParallel(TorchFunctionMode):
    """Routes ``F.cross_entropy`` of a marked shard to :func:`vocab_parallel_cross_entropy`
    and refuses every other operation that would read the shard's values."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            self.calls += 1
            return _cross_entropy(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        shard = next((s for a in args if (s := shard_of(a)) is not None), None)
        if shard is None:
            return func(*args, **kwargs)
        if name in _METADATA:
            out = func(*args, **kwargs)
            if not isinstance(out, torch.Tensor):
                return out
        elif name in ("reshape", "view") and (shape := _leading_reshape(args, shard)):
            return mark_shard(func(args[0], shape), shard.vocab, shard.group)
        elif _keeps_columns(name, args, kwargs):
            return mark_shard(func(*args, **kwargs), shard.vocab, shard.group)
        raise ValueError(
            f"the loss applied {name} to logits split by vocabulary over the tensor-parallel "
            "group (a 'colwise_loss_parallel' head): only F.cross_entropy runs on them (after "
            "reshapes and indexing of the leading dims and dtype casts); compute other "
            "metrics outside the loss, or gather the logits ('colwise_gather_output')"
        )


def _cross_entropy(*args: Any, **kwargs: Any) -> torch.Tensor:
    bound = _CROSS_ENTROPY.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    shard = shard_of(given["input"])
    if shard is None:
        raise ValueError(
            "the loss computed F.cross_entropy of logits that are not the output of the head "
            "split by vocabulary ('colwise_loss_parallel') as it left the model: only "
            "reshapes, dtype casts and indexing of the leading dims may come between; "
            "gather the logits ('colwise_gather_output') for another loss"
        )
    unsupported = [k for k in ("size_average", "reduce") if given[k] is not None]
    logits = given["input"]
    if unsupported or logits.dim() != 2:
        what = ", ".join(unsupported) or f"logits of {logits.dim()} dims"
        raise ValueError(
            f"F.cross_entropy of logits split by vocabulary takes {what}, which the "
            "vocabulary-parallel cross-entropy does not support: give (tokens, vocabulary) "
            "logits, integer targets, weight, ignore_index, reduction and label_smoothing only"
        )
    return vocab_parallel_cross_entropy(
        logits,
        given["target"],
        shard.group,
        given["ignore_index"],
        given["reduction"],
        given["label_smoothing"],
        given["weight"],
    )


def _leading_reshape(args: Sequence[Any], shard: VocabShard) -> tuple[int, ...] | None:
    """The shape a reshape of a shard asks for, its last dim the shard's own (the whole
    vocabulary ``V`` read as the shard's ``V / T``); None if it would move columns."""
    shape = args[1:]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if not shape or not all(isinstance(d, int) for d in shape):
        return None
    local = args[0].shape[-1]
    if shape[-1] not in (local, shard.vocab):
        return None
    return (*shape[:-1], local)


def _keeps_columns(name: str, args: Sequence[Any], kwargs: Any) -> bool:
    """Whether ``name(*args, **kwargs)`` keeps the shard's columns whole and last."""
    if name == "flatten":
        return _flattens_leading(args, kwargs)
    if name == "__getitem__":
        return _indexes_leading(args[0], args[1])
    return name in _KEEP


def _flattens_leading(args: Sequence[Any], kwargs: Any) -> bool:
    tensor = args[0]
    end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
    return bool(end % tensor.dim() < tensor.dim() - 1)


def _indexes_leading(tensor: torch.Tensor, index: Any) -> bool:
    """Whether ``tensor[index]`` keeps the last dim whole and last."""
    parts = index if isinstance(index, tuple) else (index,)
    if parts and isinstance(parts[-1], slice) and parts[-1] == slice(None):
        return not any(p is None for p in parts)
    used = 0
    for part in parts:
        if part is None or part is Ellipsis:
            return False
        is_mask = isinstance(part, torch.Tensor) and part.dtype == torch.bool
        used += part.dim() if is_mask else 1
    return used < tensor.dim()


@contextmanager
def loss_parallel() -> Iterator[_LossParallel]:
    """Inside, ``F.cross_entropy`` of logits marked as a vocabulary shard (a
    ``"colwise_loss_parallel"`` head's output) is :func:`vocab_parallel_cross_entropy` over
    their group; every other operation on them, but reshapes and indexing of the leading
    dims, dtype casts and questions of shape, raises ``ValueError``. Yields the mode, whose
    ``calls`` counts the cross-entropies computed."""
    with _LossParallel() as mode:
        yield mode
