"""Weight-gradient products of float16 stashes, in float32.

A concatenated ``W`` sums the products of ``m`` micro-batches in one
operation: in float16 its result is ``m`` times larger than one micro-batch's
and overflows (65504) where each part alone would not, above all under a
loss scale. Per micro-batch, each product would be added to the float32
``.grad`` on its own. So the products of float16 operands return float32
here: on CUDA a float16 product with a float32 output (``out_dtype``, float32
accumulation as cuBLAS does anyway), elsewhere a float32 product of the
operands cast up (on the CPU faster than a float16 product, which it
emulates). Bfloat16 has float32's range and is left as it is.
"""

from __future__ import annotations

import torch
from torch import Tensor


def wide(t: Tensor) -> bool:
    """True if products of ``t`` are widened to float32 here (it is float16)."""
    return t.dtype == torch.float16


def weight_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (2-D); float32 for float16 operands."""
    if not wide(a):
        return torch.mm(a, b)
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (NotImplementedError, RuntimeError, TypeError):
            pass
    return torch.mm(a.float(), b.float())


def weight_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul(a, b)`` (batched); float32 for float16 operands."""
    if not wide(a):
        return torch.matmul(a, b)
    return torch.matmul(a.float(), b.float())


def row_sum(dy: Tensor) -> Tensor:
    """``dy.sum(0)``; float32 for float16 (a bias gradient over the rows of every micro-batch)."""
    return dy.sum(0, dtype=torch.float32) if wide(dy) else dy.sum(0)
