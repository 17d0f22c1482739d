"""Megatron-style tensor parallelism inside a block, on plain local parameters.

A plan maps module-name patterns inside a block (fnmatch, as Hugging Face's
``base_model_tp_plan``) to ``"colwise"`` or ``"rowwise"``. A column-parallel linear keeps
the rows of its weight that belong to this rank; its input passes through
:class:`_CopyToGroup` (identity forward, all-reduce of the input gradient backward). A
row-parallel linear keeps the columns of its weight; its output passes through
:class:`_ReduceFromGroup` (all-reduce forward, identity backward). Every weight gradient
(``dW = dY_local^T X``) is local, so the 2BP engine defers it as any other.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STYLES = ("colwise", "rowwise")

_LLAMA_PLAN = {
    "attn.wq": "colwise",
    "attn.wk": "colwise",
    "attn.wv": "colwise",
    "attn.wo": "rowwise",
    "mlp.w1": "colwise",
    "mlp.w3": "colwise",
    "mlp.w2": "rowwise",
}


def tensor_parallel_plan(name: str) -> dict[str, str]:
    """The tensor-parallel plan of a reference model's decoder blocks.

    Args:
        name: the model family (``"llama"``).

    Returns:
        A mapping from module-name pattern to ``"colwise"`` or ``"rowwise"``.

    Raises:
        ValueError: if no plan ships for ``name``.
    """
    if name != "llama":
        raise ValueError(f"tensor_parallel_plan: no plan ships for {name!r}; known: 'llama'")
    return dict(_LLAMA_PLAN)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def shard_block(block: nn.Module, plan: Mapping[str, str], group: Any = None) -> nn.Module:
    """Split ``block``'s linears over ``group`` as ``plan`` says, in place.

    Args:
        block: one pipeline block, with every rank of ``group`` holding the same weights.
        plan: module-name pattern -> ``"colwise"`` or ``"rowwise"``.
        group: the tensor-parallel process group (None: the default group).

    Returns:
        ``block``, its planned linears holding this rank's shard.

    Raises:
        ValueError: if a pattern names no module, names a module that is not an
            ``nn.Linear``, a style is unknown, a width or a module's ``n_heads`` does not
            divide by the group size, or a row-parallel linear has a bias; the message
            names the module.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chosen = _match(block, plan)
    for name, module in block.named_modules():
        heads = getattr(module, "n_heads", None)
        if isinstance(heads, int) and heads % size:
            raise ValueError(
                f"tensor parallel: {name or 'block'} has {heads} heads, "
                f"which do not divide by {size} ranks; choose a tensor_parallel that divides it"
            )
    for name, (module, style) in chosen.items():
        _check(name, module, style, size)
    for module, style in chosen.values():
        assert isinstance(module, nn.Linear)  # _check refused the rest
        _shard_linear(module, style, size, rank, group)
    for module in block.modules():
        heads = getattr(module, "n_heads", None)
        if isinstance(heads, int):
            vars(module)["n_heads"] = heads // size  # the heads this rank holds
    return block


def _match(block: nn.Module, plan: Mapping[str, str]) -> dict[str, tuple[nn.Module, str]]:
    modules = dict(block.named_modules())
    chosen: dict[str, tuple[nn.Module, str]] = {}
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


def _check(name: str, module: nn.Module, style: str, size: int) -> None:
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"tensor parallel: {name} is a {type(module).__name__}; "
            "the plan can split only nn.Linear modules"
        )
    width = module.out_features if style == "colwise" else module.in_features
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


def _shard_linear(module: nn.Linear, style: str, size: int, rank: int, group: Any) -> None:
    dim = 0 if style == "colwise" else 1
    with torch.no_grad():
        module.weight = nn.Parameter(module.weight.chunk(size, dim=dim)[rank].clone())
        if module.bias is not None:
            module.bias = nn.Parameter(module.bias.chunk(size)[rank].clone())
    if style == "colwise":
        module.out_features //= size
        module.register_forward_pre_hook(
            lambda _m, args: (_CopyToGroup.apply(args[0], group),)  # type: ignore[no-untyped-call]
        )
    else:
        module.in_features //= size
        module.register_forward_hook(
            lambda _m, _args, out: _ReduceFromGroup.apply(out, group)  # type: ignore[no-untyped-call]
        )
