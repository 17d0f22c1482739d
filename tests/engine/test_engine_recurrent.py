"""nn.RNN, nn.GRU, nn.LSTM: every recurrent weight deferred to W, gradients equal to autograd.

Float64 against plain autograd of the same modules (1e-10, every W grouping and an
interleaved order); bfloat16 autocast against plain autograd under the same autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_harness import assert_matches, randn, seeded
from test_engine_autocast import BF16_TOL, relative_errors
from torch import Tensor, nn

from twobp.engine import defer_weight_grads
from twobp.engine.coverage import Route, deferred_share


class SpeechBlock(nn.Module):
    """A convolution, a recurrent stack and a linear head (DeepSpeech's shape)."""

    def __init__(self, rnn: nn.Module, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=1)
        self.rnn = rnn
        self.head = nn.Linear(width, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)  # (B, T, 4)
        if not getattr(self.rnn, "batch_first", True):
            h = h.transpose(0, 1)
        out = self.rnn(h)[0]
        if not getattr(self.rnn, "batch_first", True):
            out = out.transpose(0, 1)
        return self.head(out)


RNNS = {
    "gru 2 layers bidirectional": (
        lambda: nn.GRU(4, 6, 2, batch_first=True, bidirectional=True),
        12,
    ),
    "lstm 2 layers bidirectional": (
        lambda: nn.LSTM(4, 6, 2, batch_first=True, bidirectional=True),
        12,
    ),
    "lstm with projection": (lambda: nn.LSTM(4, 6, 2, batch_first=True, proj_size=3), 3),
    "rnn tanh time first": (lambda: nn.RNN(4, 6, 2, bidirectional=True), 12),
    "rnn relu without bias": (
        lambda: nn.RNN(4, 6, 1, nonlinearity="relu", bias=False, batch_first=True),
        6,
    ),
}


def _inputs(mb: int) -> list[tuple[Tensor, bool]]:
    return [(randn(2 + mb % 2, 5, 3, seed=mb), True)]


@pytest.mark.parametrize("name", RNNS)
def test_recurrent_weights_are_deferred_with_autograd_gradients(name):
    make_rnn, width = RNNS[name]
    store = assert_matches(seeded(lambda: SpeechBlock(make_rnn(), width)), _inputs)
    routes = store.routes()
    rnn_routes = [r for r in routes if r.name.startswith("rnn.")]
    assert rnn_routes and all(r.route is Route.DEFERRED for r in rnn_routes), store.report()
    assert deferred_share(routes) == 1.0, store.report()
    assert "torch." in rnn_routes[0].reason, rnn_routes[0].reason


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_deferred_share_of_a_bidirectional_two_layer_block_is_at_least_99_percent(kind):
    torch.manual_seed(0)
    block = SpeechBlock(kind(4, 6, 2, batch_first=True, bidirectional=True), 12).double()
    store = defer_weight_grads(block)
    with store.forward(0):
        out = block(randn(2, 5, 3, seed=0))
    store.backward_input(0, [out], [torch.ones_like(out)], [])
    store.backward_weight([0])
    store.finish_step()
    assert deferred_share(store.routes()) >= 0.99, store.report()


def test_hidden_weight_gradient_is_one_product_over_all_steps_of_all_microbatches():
    """W reads every step of every micro-batch held: one deferred op per weight, its stashes
    hold one entry per time step and micro-batch."""
    torch.manual_seed(0)
    block = SpeechBlock(nn.GRU(4, 6, 1, batch_first=True), 6).double()
    store = defer_weight_grads(block)
    for mb in range(2):
        with store.forward(mb):
            out = block(randn(2, 5, 3, seed=mb))
        store.backward_input(mb, [out], [torch.ones_like(out)], [])
    hidden = [op for op in store._ops() if "weight_hh" in op.name]
    assert len(hidden) == 1, [op.name for op in store._ops()]
    for mb in range(2):
        assert len(store._stash[mb][hidden[0].index]) == 5  # one per time step
    assert block.rnn.weight_hh_l0.grad is None  # nothing before W
    store.backward_weight([0, 1])
    store.finish_step()
    assert block.rnn.weight_hh_l0.grad is not None


def test_bfloat16_autocast_matches_autograd_under_the_same_autocast():
    torch.manual_seed(0)
    model = SpeechBlock(nn.GRU(4, 6, 2, batch_first=True, bidirectional=True), 12)
    reference = copy.deepcopy(model)
    store = defer_weight_grads(model)
    for mb in range(3):
        x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(mb))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference(x).float().square().mean().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16), store.forward(mb):
            loss = model(x).float().square().mean()
        store.backward_input(mb, [loss], [None], [])
    store.backward_weight(range(3))
    store.finish_step()
    errors = relative_errors(model, reference)
    assert max(errors.values()) <= BF16_TOL, errors
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


class PackedBlock(nn.Module):
    """A recurrent stack over a packed batch of unequal, unsorted lengths."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: Tensor) -> Tensor:
        lengths = [5, 2, 4][: x.shape[0]]
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, True, enforce_sorted=False)
        out, state = self.rnn(packed)
        padded = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]
        states = state if isinstance(state, tuple) else (state,)
        return torch.cat([padded.sum(1), *[h.transpose(0, 1).flatten(1) for h in states]], -1)


PACKED = {
    "gru": lambda: nn.GRU(3, 4, 2, batch_first=True, bidirectional=True),
    "lstm": lambda: nn.LSTM(3, 4, 2, batch_first=True, bidirectional=True),
    "lstm with projection": lambda: nn.LSTM(3, 4, 1, batch_first=True, proj_size=2),
}


@pytest.mark.parametrize("name", PACKED)
def test_packed_sequences_are_deferred_with_autograd_gradients(name):
    store = assert_matches(
        seeded(lambda: PackedBlock(PACKED[name]())), lambda mb: [(randn(3, 5, 3, seed=mb), True)]
    )
    assert deferred_share(store.routes()) == 1.0, store.report()
