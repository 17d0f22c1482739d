"""The covered operations: which torch functions the capture splits, one module per family.

A new covered operation is a :class:`~twobp.engine.deferred.DeferredOp`
subclass, a handler that reads a call's arguments, and an entry in
:data:`HANDLERS` for each torch function that reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from twobp.engine.capture import Handler
from twobp.engine.ops.batchnorm import capture_batch_norm
from twobp.engine.ops.conv import capture_conv1d, capture_conv2d, capture_conv3d
from twobp.engine.ops.embedding import capture_embedding
from twobp.engine.ops.experts import capture_grouped_mm
from twobp.engine.ops.linear import capture_linear
from twobp.engine.ops.matmul import capture_addmm, capture_bmm, capture_matmul, capture_mm
from twobp.engine.ops.norm import (
    capture_group_norm,
    capture_layer_norm,
    capture_rms_norm,
    capture_rms_norm_affine,
    rms_norm_affine,
)
from twobp.engine.ops.recurrent import (
    capture_gru,
    capture_lstm,
    capture_rnn_relu,
    capture_rnn_tanh,
)

HANDLERS: dict[Callable[..., Any], Handler] = {
    F.linear: capture_linear,
    torch.addmm: capture_addmm,
    torch.Tensor.addmm: capture_addmm,
    torch.matmul: capture_matmul,
    torch.Tensor.matmul: capture_matmul,
    torch.Tensor.__matmul__: capture_matmul,
    torch.mm: capture_mm,
    torch.Tensor.mm: capture_mm,
    torch.bmm: capture_bmm,
    torch.Tensor.bmm: capture_bmm,
    **{
        f: capture_grouped_mm
        for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None))
        if f is not None
    },
    F.conv1d: capture_conv1d,
    F.conv2d: capture_conv2d,
    F.conv3d: capture_conv3d,
    F.embedding: capture_embedding,
    F.layer_norm: capture_layer_norm,
    F.rms_norm: capture_rms_norm,
    rms_norm_affine: capture_rms_norm_affine,
    F.group_norm: capture_group_norm,
    F.batch_norm: capture_batch_norm,
    torch.gru: capture_gru,
    torch.lstm: capture_lstm,
    torch.rnn_tanh: capture_rnn_tanh,
    torch.rnn_relu: capture_rnn_relu,
}
"""Every covered torch function and the handler that splits its calls."""

__all__ = ["HANDLERS"]
