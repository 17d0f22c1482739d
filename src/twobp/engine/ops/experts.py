"""Grouped products over stacked expert weights: ``torch._grouped_mm`` and ``F.grouped_mm``.

A mixture-of-experts layer stores its experts as one parameter
``[experts, in, out]`` (or ``[experts, out, in]`` read through
``transpose(-2, -1)``, as Hugging Face's ``grouped_mm`` experts do) and
multiplies the tokens sorted by expert with ``grouped_mm(x, w, offs=offs)``:
rows ``offs[e-1]:offs[e]`` of ``x`` go through expert ``e``. I computes
``dx`` per group (``dY_e @ w[e]^T``); W concatenates each expert's rows over
every stashed call and micro-batch, ``dw[e] = cat(x_e)^T @ cat(dY_e)``,
whatever the number of rows each expert got (none gives a zero gradient).

The other two ways experts are written need nothing here: ``bmm`` over the
experts dimension is a batched :mod:`~twobp.engine.ops.matmul`, and one
expert's slice ``w[e]`` is a view the capture follows (a ``select`` step of
:mod:`twobp.engine.operand`), so ``F.linear(x, w[e])`` is deferred per expert.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from twobp.engine.autocast import AutocastRule
from twobp.engine.capture import Capture, Captured, Kwargs
from twobp.engine.deferred import DeferredOp, in_input_dtype
from twobp.engine.precision import weight_mm
from twobp.engine.stash import SharedRows


def _bounds(offs: Tensor, rows: int) -> list[tuple[int, int]]:
    """Each group's ``(start, end)`` rows (one host read of the offsets)."""
    ends = [min(int(e), rows) for e in offs.tolist()]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def grouped_product(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``grouped_mm(x, w, offs=offs)`` for any dtype: rows past ``offs[-1]`` are zeros.

    CUDA runs torch's kernel where it takes the dtype; elsewhere (and in
    float64, which the kernel refuses) one product per group.
    """
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        try:
            return torch._grouped_mm(x, w, offs=offs)
        except RuntimeError:
            pass
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for e, (start, end) in enumerate(_bounds(offs, x.shape[0])):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
    return out


class DeferredGroupedMM(DeferredOp):
    """``grouped_mm(x, P, offs=offs)`` with ``P`` stacked expert weights ``[experts, in, out]``."""

    autocast_rule = AutocastRule.UNCHANGED  # grouped_mm is not autocast-enabled

    def forward(
        self, x: Tensor, params: Sequence[Tensor | None], call: Any
    ) -> tuple[Tensor, tuple[Tensor | None, ...], Any]:
        weight = self.weights(params, None)[0]
        assert weight is not None
        offs: Tensor = call[1]
        return grouped_product(x, weight, offs), (x, weight, offs), None

    def input_grad(
        self, grad_out: Tensor, saved: Sequence[Tensor], state: Any, needs_input_grad: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        x, weight, offs = saved
        grad_in = None
        if needs_input_grad:
            grad_in = in_input_dtype(grouped_product(grad_out, weight.mT, offs), x.dtype)
        return grad_in, (x, grad_out, offs)

    def accumulate_weight_grads(
        self, stashes: Sequence[tuple[Tensor, ...]], shared: SharedRows
    ) -> None:
        weight = self.operands[0]
        assert weight is not None
        if not weight.param.requires_grad:
            return
        bounds = [_bounds(offs, x.shape[0]) for x, _, offs in stashes]
        grads = []
        for e in range(len(bounds[0])):
            xs = [s[0][b[e][0] : b[e][1]] for s, b in zip(stashes, bounds, strict=True)]
            dys = [s[1][b[e][0] : b[e][1]] for s, b in zip(stashes, bounds, strict=True)]
            # One product per expert over every call and micro-batch: its rows
            # are the tokens routed to it, a few per micro-batch.
            grads.append(weight_mm(torch.cat(xs).t(), torch.cat(dys)))
        weight.add_grad(torch.stack(grads))


_GROUPED = ("mat_a", "mat_b")


def capture_grouped_mm(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``torch._grouped_mm`` / ``F.grouped_mm`` with stacked expert weights as ``mat_b``."""
    kw = dict(kwargs or {})
    values = list(args) + [kw.pop(k) for k in _GROUPED[len(args) :] if k in kw]
    if len(values) < 2:
        return None
    x, w = values[0], values[1]
    param = capture.operand(w)
    if not param:
        return "grouped_mm with a parameter as mat_a" if capture.operand(x) else None
    offs = values[2] if len(values) > 2 else kw.pop("offs", None)
    extra = {k: v for k, v in kw.items() if v is not None}
    if not isinstance(x, Tensor) or not isinstance(offs, Tensor) or extra or len(values) > 3:
        return "grouped_mm without offsets, or with a bias, scales or an out_dtype"
    if x.dim() != 2 or w.dim() != 3 or offs.numel() != w.shape[0]:
        return "grouped_mm other than 2-D tokens by 3-D experts with one offset per expert"
    name = f"grouped_mm per expert x{w.shape[0]}"
    return capture.run(DeferredGroupedMM, name, None, x, param, None, offs)
