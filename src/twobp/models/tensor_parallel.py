"""Megatron-style tensor parallelism inside a block, on plain local parameters.

A plan maps module-name patterns inside a block (fnmatch, as Hugging Face's
``base_model_tp_plan``) to a style. A ``"colwise"`` linear keeps the rows of its weight
that belong to this rank; its input passes through :class:`_CopyToGroup` (identity
forward, all-reduce of the input gradient backward), once for the column-parallel linears
that read one tensor (``q``, ``k``, ``v``; ``w1``, ``w3``): one all-reduce of their summed
input gradients. A ``"colwise_gather_output"`` linear
(an output head: Hugging Face's name, torch's ``ColwiseParallel(output_layouts=Replicate())``)
is split the same way and its output gathered over the group (:class:`_GatherFromGroup`),
so that the loss sees whole logits. A ``"colwise_loss_parallel"`` linear (a head, as
torchtitan's ``loss_parallel``) is split the same way and its output left split: the loss
computes :func:`vocab_parallel_cross_entropy` on the shards (:mod:`twobp.models.vocab_parallel`).
A ``"rowwise"`` linear keeps the columns of its weight;
its output passes through :class:`_ReduceFromGroup` (all-reduce forward, identity backward).
A ``"rowwise"`` embedding (torch's sense of ``RowwiseParallel`` on an ``nn.Embedding``;
Hugging Face's ``"embedding_rowwise"``) keeps its rows of the vocabulary: each rank looks
up the ids in its range, zeros the others, and the output is all-reduced.

A weight shared by several modules (a head tied to the embedding) is split once and
stays shared: a linear that reads a split embedding's weight becomes a
``"colwise_gather_output"`` head, an embedding whose weight a column-parallel head
reads becomes ``"rowwise"``. Every weight gradient (``dW = dY_local^T X``, the rows an
embedding looked up) is local, so the 2BP engine defers it as any other.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twobp.models.vocab_parallel import mark_shard, vocab_parallel_cross_entropy

STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_loss_parallel",
    "embedding_rowwise",
)
_LINEAR_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_loss_parallel")
LOSS_PARALLEL = "colwise_loss_parallel"
"""A column-parallel head whose logits stay split for the vocabulary-parallel loss."""

__all__ = [
    "LOSS_PARALLEL",
    "STYLES",
    "shard_block",
    "shard_blocks",
    "tensor_parallel_plan",
    "vocab_parallel_cross_entropy",
    "while_reducing",
]

_LLAMA_PLAN = {
    "attn.wq": "colwise",
    "attn.wk": "colwise",
    "attn.wv": "colwise",
    "attn.wo": "rowwise",
    "mlp.w1": "colwise",
    "mlp.w3": "colwise",
    "mlp.w2": "rowwise",
}


def tensor_parallel_plan(name: str, *, loss_parallel: bool = False) -> dict[str, str]:
    """The tensor-parallel plan of a reference model's decoder blocks.

    Args:
        name: the model family (``"llama"``).
        loss_parallel: also split the embedding by vocabulary and the head by columns, its
            logits left split for :func:`vocab_parallel_cross_entropy` (the model's
            ``F.cross_entropy`` runs on the shards, see :mod:`twobp.models.vocab_parallel`).

    Returns:
        A mapping from module-name pattern to a style of :data:`STYLES`.

    Raises:
        ValueError: if no plan ships for ``name``.
    """
    if name != "llama":
        raise ValueError(f"tensor_parallel_plan: no plan ships for {name!r}; known: 'llama'")
    vocabulary = {"embed": "rowwise", "output": LOSS_PARALLEL} if loss_parallel else {}
    return {**_LLAMA_PLAN, **vocabulary}


_WHILE_REDUCING: ContextVar[Callable[[Any], None] | None] = ContextVar(
    "twobp_while_reducing", default=None
)
"""What runs while a column-parallel linear's input gradient is all-reduced, if anything."""


@contextmanager
def while_reducing(run: Callable[[Any], None]) -> Iterator[None]:
    """While inside, a column-parallel linear's backward starts the all-reduce of its input
    gradient asynchronously and calls ``run(work)`` before waiting for ``work`` (a
    ``torch.distributed`` work handle): other computation, with no collective of its own
    (a deferred ``W``), can run while the all-reduce is in flight.

    Args:
        run: called with the work handle; returns whenever it likes (the wait follows).
    """
    token = _WHILE_REDUCING.set(run)
    try:
        yield
    finally:
        _WHILE_REDUCING.reset(token)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        run = _WHILE_REDUCING.get()
        if run is None:
            dist.all_reduce(grad, group=ctx.group)
            return grad, None
        work = dist.all_reduce(grad, group=ctx.group, async_op=True)
        try:
            run(work)
        finally:
            work.wait()
        return grad, None


_Copies = list[tuple[torch.Tensor, Any, torch.Tensor]]
"""Within one forward of a block: each input a column-parallel linear read, its group, and
the copy it read it through."""


def _copy_to_group(x: torch.Tensor, group: Any, copies: _Copies) -> torch.Tensor:
    """``x`` through :class:`_CopyToGroup`, once for the column-parallel linears of one
    block forward that read the same tensor (``q``, ``k`` and ``v``; a SwiGLU's ``w1`` and
    ``w3``): their input gradients add up before one all-reduce, not one each (as
    Megatron's fused QKV and gate-up projections reduce)."""
    for seen, seen_group, copied in copies:
        if seen is x and seen_group is group:
            return copied
    copy: torch.Tensor = _copy(x, group)
    copies.append((x, group, copy))
    return copy


# The collectives run outside a compiled region (a graph break): torch.compile of a stage
# (``Pipeline(compile=True)``) compiles what lies between them.
@torch.compiler.disable  # type: ignore[untyped-decorator]
def _copy(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _GatherFromGroup.apply(x, group)  # type: ignore[no-any-return,no-untyped-call]


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.size, ctx.rank = dist.get_world_size(group), dist.get_rank(group)
        pieces = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank's loss is the whole model's: its own columns of the gradient.
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


def shard_block(block: nn.Module, plan: Mapping[str, str], group: Any = None) -> nn.Module:
    """Split ``block``'s linears (and embeddings) over ``group`` as ``plan`` says, in place.

    Args:
        block: one pipeline block, with every rank of ``group`` holding the same weights.
        plan: module-name pattern -> a style of :data:`STYLES` (``"rowwise"`` on an
            embedding splits its vocabulary).
        group: the tensor-parallel process group (None: the default group).

    Returns:
        ``block``, its planned modules holding this rank's shard.

    Raises:
        ValueError: if a pattern names no module, names a module that is neither an
            ``nn.Linear`` nor an ``nn.Embedding``, a style is unknown or does not fit the
            module, a width, a vocabulary or a module's ``n_heads`` does not divide by the
            group size, a row-parallel linear has a bias, or a weight shared with another
            module would be split two ways; the message names the module.
    """
    shard_blocks([block], [plan], group)
    return block


def shard_blocks(
    blocks: Sequence[nn.Module], plans: Sequence[Mapping[str, str]], group: Any = None
) -> list[dict[str, str]]:
    """Split each of ``blocks`` by its plan over ``group``, in place; a weight shared
    across blocks (a head tied to the embedding) is split once and stays shared.

    Args:
        blocks: the whole model's blocks, the same weights on every rank of ``group``.
        plans: per block, module-name pattern -> style (an empty plan leaves it whole).
        group: the tensor-parallel process group (None: the default group).

    Returns:
        Per block, the style of every module split, by its name in the block: the
        plan's, and a tied partner's (a head that reads a split embedding's weight).

    Raises:
        ValueError: what :func:`shard_block` refuses, naming the block and the module.
    """
    chosen = planned_modules(blocks, plans)
    shards: Shards = {}
    for index, (block, modules) in enumerate(zip(blocks, chosen, strict=True)):
        if modules:
            with _naming_block(index, len(blocks)):
                _split(block, modules, group, shards)
    return [{name: style for name, (_, style) in modules.items()} for modules in chosen]


def planned_modules(
    blocks: Sequence[nn.Module], plans: Sequence[Mapping[str, str]]
) -> list[Chosen]:
    """Per block, the modules ``plans`` split (and their tied partners), each with its
    style, checked but not split.

    Raises:
        ValueError: what :func:`shard_block` refuses of a plan whatever the size,
            naming the block and the module.
    """
    chosen = []
    for index, (block, plan) in enumerate(zip(blocks, plans, strict=True)):
        with _naming_block(index, len(blocks)):
            chosen.append(_resolve(block, plan))
    _add_tied_partners(blocks, chosen)
    return chosen


def check_divides(blocks: Sequence[nn.Module], chosen: Sequence[Chosen], size: int) -> None:
    """Refuse a split of ``blocks`` over ``size`` ranks that does not divide.

    Raises:
        ValueError: a module's ``n_heads``, a split linear's width or a split
            vocabulary that does not divide by ``size``, naming the block and the module.
    """
    for index, (block, modules) in enumerate(zip(blocks, chosen, strict=True)):
        if modules:
            with _naming_block(index, len(blocks)):
                _check_divides(block, modules, size)


@contextmanager
def _naming_block(index: int, count: int) -> Iterator[None]:
    """Errors inside name the block (of several)."""
    try:
        yield
    except ValueError as exc:
        if count == 1:
            raise
        raise ValueError(f"block {index}: {exc}") from exc


Chosen = dict[str, tuple[nn.Module, str]]
"""Module name in the block -> (the module, its style)."""

Shards = dict[int, tuple[torch.Tensor, nn.Parameter]]
"""``id`` of a whole parameter -> (it, this rank's shard of it), one shard per weight."""


def _resolve(block: nn.Module, plan: Mapping[str, str]) -> Chosen:
    """The modules ``plan`` names, each with its style (an embedding's ``"rowwise"`` as
    ``"embedding_rowwise"``), checked."""
    chosen = _match(block, plan)
    for name, (module, style) in chosen.items():
        if isinstance(module, nn.Embedding) and style == "rowwise":
            chosen[name] = (module, "embedding_rowwise")
        _check_kind(name, *chosen[name])
    return chosen


def _split(block: nn.Module, chosen: Chosen, group: Any, shards: Shards) -> None:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_divides(block, chosen, size)
    copies: _Copies = []  # held from the block's forward's start to its end
    block.register_forward_pre_hook(lambda _m, _args: copies.clear())
    block.register_forward_hook(lambda _m, _args, _out: copies.clear())
    for module, style in chosen.values():
        if isinstance(module, nn.Embedding):
            _shard_embedding(module, size, rank, group, shards)
        else:
            assert isinstance(module, nn.Linear)  # _check_kind refused the rest
            _shard_linear(module, style, size, rank, group, shards, copies)
    for module in block.modules():
        heads = getattr(module, "n_heads", None)
        if isinstance(heads, int):
            vars(module)["n_heads"] = heads // size  # the heads this rank holds


def _check_divides(block: nn.Module, chosen: Chosen, size: int) -> None:
    for name, module in block.named_modules():
        heads = getattr(module, "n_heads", None)
        if isinstance(heads, int) and heads % size:
            raise ValueError(
                f"tensor parallel: {name or 'block'} has {heads} heads, "
                f"which do not divide by {size} ranks; choose a tensor_parallel that divides it"
            )
    for name, (module, style) in chosen.items():
        _check(name, module, style, size)


def _match(block: nn.Module, plan: Mapping[str, str]) -> Chosen:
    modules = dict(block.named_modules())
    chosen: Chosen = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"tensor parallel: {pattern!r} has style {style!r}; choose one of {STYLES}"
            )
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise ValueError(
                f"tensor parallel: the plan's {pattern!r} names no module of the block; "
                f"its modules are {sorted(n for n in modules if n)}"
            )
        chosen.update({n: (modules[n], style) for n in names})
    return chosen


def _check_kind(name: str, module: nn.Module, style: str) -> None:
    if isinstance(module, nn.Embedding):
        if style != "embedding_rowwise":
            raise ValueError(
                f"tensor parallel: {name} is an nn.Embedding planned {style!r}; an embedding "
                "splits only by vocabulary rows: give 'rowwise' (or 'embedding_rowwise')"
            )
    elif not isinstance(module, nn.Linear):
        raise ValueError(
            f"tensor parallel: {name} is a {type(module).__name__}; "
            "the plan can split only nn.Linear and nn.Embedding modules"
        )
    elif style not in _LINEAR_STYLES:
        raise ValueError(
            f"tensor parallel: {name} is an nn.Linear planned {style!r}; "
            f"choose one of {_LINEAR_STYLES}"
        )


def _split_dim(module: nn.Module, style: str) -> int:
    """The dim of the module's weight that its style splits."""
    return 1 if isinstance(module, nn.Linear) and style == "rowwise" else 0


def _add_tied_partners(blocks: Sequence[nn.Module], chosen: list[Chosen]) -> None:
    """Give every other holder of a split weight its part: a linear reading a split
    embedding's weight becomes a gathered head, an embedding whose weight a column-parallel
    linear reads is split by vocabulary; refuse a holder that would split it another way."""
    split: dict[int, tuple[int, str, int]] = {}  # id(weight) -> (block, name, dim)
    for index, modules in enumerate(chosen):
        for name, (module, planned) in modules.items():
            split.setdefault(id(module.weight), (index, name, _split_dim(module, planned)))
    for index, block in enumerate(blocks):
        for name, module in block.named_modules():
            for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
                if id(param) not in split:
                    continue
                first_block, first, dim = split[id(param)]
                style: str | None = chosen[index][name][1] if name in chosen[index] else None
                if style is None and dim == 0 and isinstance(module, nn.Embedding):
                    style = "embedding_rowwise"
                elif style is None and dim == 0 and isinstance(module, nn.Linear):
                    style = "colwise_gather_output"
                if attr != "weight" or style is None or _split_dim(module, style) != dim:
                    raise ValueError(
                        f"tensor parallel: block {index}'s {name or 'block'}.{attr} "
                        f"({type(module).__name__}) is the weight of block {first_block}'s "
                        f"{first}, which the plan splits along dim {dim}; plan both to split "
                        "it alike (a vocabulary-split embedding and a column-parallel head) "
                        "or neither"
                    )
                chosen[index][name] = (module, style)


def _check(name: str, module: nn.Module, style: str, size: int) -> None:
    if isinstance(module, nn.Embedding):
        _check_embedding(name, module, size)
        return
    assert isinstance(module, nn.Linear)
    width = module.in_features if style == "rowwise" else module.out_features
    if width % size:
        raise ValueError(
            f"tensor parallel: {name} ({style}) has width {width}, "
            f"which does not divide by {size} ranks; choose a tensor_parallel that divides it"
        )
    if style == "rowwise" and module.bias is not None:
        raise ValueError(
            f"tensor parallel: {name} is row-parallel with a bias, which is not supported; "
            "make it bias-free or leave it out of the plan"
        )


def _check_embedding(name: str, module: nn.Embedding, size: int) -> None:
    if module.num_embeddings % size:
        raise ValueError(
            f"tensor parallel: {name} (embedding_rowwise) has a vocabulary of "
            f"{module.num_embeddings}, which does not divide by {size} ranks; pad the "
            "vocabulary to a multiple or choose a tensor_parallel that divides it"
        )
    if module.max_norm is not None or module.scale_grad_by_freq:
        raise ValueError(
            f"tensor parallel: {name} is an nn.Embedding with max_norm or "
            "scale_grad_by_freq, which a vocabulary split would change; leave it out of the plan"
        )


def _shard(param: torch.Tensor, dim: int, size: int, rank: int, shards: Shards) -> nn.Parameter:
    """This rank's shard of ``param``, made once for every module that holds it."""
    if id(param) not in shards:
        with torch.no_grad():
            shard = nn.Parameter(param.chunk(size, dim=dim)[rank].clone())
        shards[id(param)] = (param, shard)  # the whole one kept: its id stays its own
    return shards[id(param)][1]


def _shard_linear(
    module: nn.Linear,
    style: str,
    size: int,
    rank: int,
    group: Any,
    shards: Shards,
    copies: _Copies,
) -> None:
    dim = _split_dim(module, style)
    module.weight = _shard(module.weight, dim, size, rank, shards)
    if module.bias is not None:
        module.bias = _shard(module.bias, 0, size, rank, shards)
    if style == "rowwise":
        module.in_features //= size
        module.register_forward_hook(lambda _m, _args, out: _reduce(out, group))
        return
    module.out_features //= size
    module.register_forward_pre_hook(lambda _m, args: (_copy_to_group(args[0], group, copies),))
    if style == "colwise_gather_output":
        module.register_forward_hook(lambda _m, _args, out: _gather(out, group))
    if style == LOSS_PARALLEL:
        vocab = module.out_features * size
        module.register_forward_hook(lambda _m, _args, out: mark_shard(out, vocab, group))


def _shard_embedding(
    module: nn.Embedding, size: int, rank: int, group: Any, shards: Shards
) -> None:
    rows = module.num_embeddings // size
    start = rank * rows
    module.weight = _shard(module.weight, 0, size, rank, shards)
    module.num_embeddings = rows
    padding = module.padding_idx
    module.padding_idx = (
        padding - start if padding is not None and 0 <= padding - start < rows else None
    )
    # Bound to the module, so that a copy of the block looks up in its own weight.
    module.forward = types.MethodType(_vocab_parallel_forward(start, group), module)  # type: ignore[method-assign]


def _vocab_parallel_forward(start: int, group: Any) -> Callable[[nn.Embedding, torch.Tensor], Any]:
    def forward(self: nn.Embedding, ids: torch.Tensor) -> Any:
        local = ids - start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0)
        return _reduce(rows, group)

    return forward
