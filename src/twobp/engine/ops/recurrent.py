"""``nn.RNN``, ``nn.GRU``, ``nn.LSTM`` with deferred weight gradients.

Their modules call ``torch.rnn_tanh``, ``torch.rnn_relu``, ``torch.gru`` and
``torch.lstm`` with every layer's weights in one list, an operation autograd
differentiates as a whole. The capture runs such a call as its unrolled cell
math instead, every product with a weight through a deferred linear op:
``X W_ih^T + b_ih`` for all time steps of a layer and direction at once, and
``h_t W_hh^T + b_hh`` (and an LSTM's projection ``h_t W_hr^T``) once per step.
I then computes the input and hidden-state gradients through the recurrence;
W computes ``dW_ih``, ``dW_hh`` and the biases as products over all time
steps of all the micro-batches it holds, as cuDNN's separate weight-gradient
call does (``cudnnRNNBackwardWeights``). The gates follow ATen's cells, so
the results equal ``nn.GRU``'s (and the others') in float64.

A packed sequence (``pack_padded_sequence``) runs step by step on the rows
that are still (or already) active at each step, as ATen does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from twobp.engine.capture import Capture, Captured, Kwargs
from twobp.engine.operand import Operand
from twobp.engine.ops.linear import DeferredLinear

Cell = Callable[[Tensor, Tensor, Tensor | None, Tensor], tuple[Tensor, Tensor | None]]
"""One time step: (input gates, hidden gates, cell state, hidden) -> (new hidden, new cell)."""


def _gru_cell(gi: Tensor, gh: Tensor, c: Tensor | None, h: Tensor) -> tuple[Tensor, None]:
    i_r, i_z, i_n = gi.chunk(3, -1)
    h_r, h_z, h_n = gh.chunk(3, -1)
    reset = torch.sigmoid(i_r + h_r)
    update = torch.sigmoid(i_z + h_z)
    new = torch.tanh(i_n + reset * h_n)
    return (h - new) * update + new, None


def _lstm_cell(gi: Tensor, gh: Tensor, c: Tensor | None, h: Tensor) -> tuple[Tensor, Tensor]:
    assert c is not None
    i, f, g, o = (gi + gh).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _tanh_cell(gi: Tensor, gh: Tensor, c: Tensor | None, h: Tensor) -> tuple[Tensor, None]:
    return torch.tanh(gi + gh), None


def _relu_cell(gi: Tensor, gh: Tensor, c: Tensor | None, h: Tensor) -> tuple[Tensor, None]:
    return torch.relu(gi + gh), None


_CELLS: dict[str, Cell] = {
    "gru": _gru_cell,
    "lstm": _lstm_cell,
    "rnn_tanh": _tanh_cell,
    "rnn_relu": _relu_cell,
}


class _Recurrence:
    """One call of a recurrent operation, unrolled with deferred products."""

    def __init__(self, capture: Capture, kind: str, operands: list[Operand | None]) -> None:
        self.capture = capture
        self.name = f"torch.{kind}"
        self.cell = _CELLS[kind]
        self.operands = operands

    def linear(self, x: Tensor, index: int, bias_index: int | None, part: str) -> Tensor:
        """``F.linear(x, weight, bias)`` of the call's weights at these indices, deferred."""
        weight = self.operands[index]
        bias = None if bias_index is None else self.operands[bias_index]
        assert weight is not None
        out = self.capture.run(DeferredLinear, self.name, part, x, weight, bias)
        if isinstance(out, Tensor):
            return out
        # Neither operand requires a gradient: nothing to defer.
        return F.linear(x, weight.param, None if bias is None else bias.param)

    def direction(
        self,
        x: Tensor,
        h: Tensor,
        c: Tensor | None,
        indices: Sequence[int | None],
        reverse: bool,
        batch_sizes: list[int] | None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """One layer in one direction over ``x``: (time, batch, features), or a packed
        sequence's data (its rows, ``batch_sizes[t]`` of them at step ``t``).

        ``indices`` are the positions of ``weight_ih``, ``weight_hh``,
        ``bias_ih``, ``bias_hh`` and ``weight_hr`` in the call's list (None: absent).
        """
        w_ih, w_hh, b_ih, b_hh, w_hr = indices
        assert w_ih is not None and w_hh is not None
        gates = self.linear(x, w_ih, b_ih, "input")
        steps = gates.unbind(0) if batch_sizes is None else torch.split(gates, batch_sizes)
        order = range(len(steps) - 1, -1, -1) if reverse else range(len(steps))
        outputs: list[Tensor] = [gates] * len(steps)
        for t in order:
            # A packed sequence's step runs on its first rows; the others keep their
            # state (forward: their last step's; reverse: the initial one, until they start).
            rows = steps[t].shape[0]
            h_now = h[:rows] if rows < h.shape[0] else h
            c_now = c[:rows] if c is not None and rows < c.shape[0] else c
            hidden = self.linear(h_now, w_hh, b_hh, "hidden")
            h_new, c_new = self.cell(steps[t], hidden, c_now, h_now)
            if w_hr is not None:
                h_new = self.linear(h_new, w_hr, None, "projection")
            outputs[t] = h_new
            h = torch.cat([h_new, h[rows:]]) if rows < h.shape[0] else h_new
            if c is not None and c_new is not None:
                c = torch.cat([c_new, c[rows:]]) if rows < c.shape[0] else c_new
        out = torch.stack(outputs) if batch_sizes is None else torch.cat(outputs)
        return out, h, c


def _layout(
    count: int, has_biases: bool, layers: int, directions: int
) -> list[list[int | None]] | str:
    """Where each layer-direction's weights are in the call's list, or why they do not fit."""
    per = count // (layers * directions) if layers * directions else 0
    expected = 4 if has_biases else 2
    if per not in (expected, expected + 1) or per * layers * directions != count:
        return "an unexpected weight list"
    layout: list[list[int | None]] = []
    for k in range(layers * directions):
        base = k * per
        biases: list[int | None] = [base + 2, base + 3] if has_biases else [None, None]
        projection = base + per - 1 if per == expected + 1 else None
        layout.append([base, base + 1, *biases, projection])
    return layout


def _capture_recurrent(
    kind: str, capture: Capture, args: tuple[Any, ...], kwargs: Kwargs
) -> Captured:
    if kwargs or len(args) != 9:
        return None
    batch_sizes: list[int] | None = None
    if isinstance(args[3], bool):
        x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
    else:  # a packed sequence: (data, batch_sizes, hx, params, ...)
        x, sizes, hx, params, has_biases, layers, dropout, train, bidirectional = args
        batch_sizes, batch_first = sizes.tolist(), False
    operands = [capture.operand(p) for p in params]
    if not any(operands):
        return None
    if not all(operands):
        return f"torch.{kind} with weights that are not all parameters of the stage"
    directions = 2 if bidirectional else 1
    layout = _layout(len(params), has_biases, layers, directions)
    if isinstance(layout, str):
        return f"torch.{kind} with {layout}"
    run = _Recurrence(capture, kind, cast(list[Operand | None], operands))
    h0, c0 = (hx[0], hx[1]) if kind == "lstm" else (hx, None)
    seq = x.transpose(0, 1) if batch_first else x
    last_h, last_c = [], []
    for layer in range(layers):
        outs = []
        for d in range(directions):
            k = layer * directions + d
            c = None if c0 is None else c0[k]
            out, h, c = run.direction(seq, h0[k], c, layout[k], d == 1, batch_sizes)
            outs.append(out)
            last_h.append(h)
            if c is not None:
                last_c.append(c)
        seq = outs[0] if directions == 1 else torch.cat(outs, -1)
        if dropout and train and layer < layers - 1:
            seq = F.dropout(seq, dropout, True)
    output = seq.transpose(0, 1) if batch_first else seq
    if kind == "lstm":
        return cast(Tensor, (output, torch.stack(last_h), torch.stack(last_c)))
    return cast(Tensor, (output, torch.stack(last_h)))


def capture_gru(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``torch.gru`` (``nn.GRU``) with stage parameters as its weights."""
    return _capture_recurrent("gru", capture, args, kwargs)


def capture_lstm(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``torch.lstm`` (``nn.LSTM``) with stage parameters as its weights."""
    return _capture_recurrent("lstm", capture, args, kwargs)


def capture_rnn_tanh(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``torch.rnn_tanh`` (``nn.RNN``) with stage parameters as its weights."""
    return _capture_recurrent("rnn_tanh", capture, args, kwargs)


def capture_rnn_relu(capture: Capture, args: tuple[Any, ...], kwargs: Kwargs) -> Captured:
    """``torch.rnn_relu`` (``nn.RNN(nonlinearity="relu")``) with stage parameters as its weights."""
    return _capture_recurrent("rnn_relu", capture, args, kwargs)
