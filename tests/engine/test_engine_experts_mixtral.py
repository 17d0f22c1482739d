"""A Hugging Face Mixtral decoder layer: its experts and router deferred, gradients exact.

Both experts codes of ``transformers`` (``eager``: one expert's slice
``w[e]`` into ``F.linear``; ``grouped_mm``: ``F.grouped_mm`` with offsets)
give plain autograd's gradients over every W plan, and at least 99% of the
layer's weight elements are deferred (the norms' weights stay immediate).
"""

from __future__ import annotations

import re

import pytest
import torch
from engine_harness import assert_matches, randn
from torch import Tensor, nn

from twobp.engine.capture import running_capture
from twobp.engine.coverage import Route, deferred_share

transformers = pytest.importorskip("transformers")

DIM = 16


class MixtralLayer(nn.Module):
    """One ``MixtralDecoderLayer`` with its rotary embedding, on hidden states."""

    def __init__(self, implementation: str, dtype: torch.dtype) -> None:
        super().__init__()
        config = transformers.MixtralConfig(
            vocab_size=32,
            hidden_size=DIM,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM._from_config(
            config, experts_implementation=implementation
        ).to(dtype)
        self.layer = model.model.layers[0]
        self.rotary = model.model.rotary_emb
        self.config = model.config
        self.implementation = implementation

    def forward(self, h: Tensor) -> Tensor:
        # torch's grouped_mm kernel refuses float64: the plain reference runs
        # transformers' eager experts (the same product, expert by expert).
        eager = running_capture() is None
        self.config._experts_implementation = "eager" if eager else self.implementation
        positions = torch.arange(h.shape[1])[None].expand(h.shape[0], -1)
        out = self.layer(h, position_embeddings=self.rotary(h, positions))
        return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_mixtral_layer_gradients_equal_autograd(implementation: str) -> None:
    store = assert_matches(
        lambda: MixtralLayer(implementation, torch.float64),
        lambda mb: [(randn(2, 3, DIM, seed=mb), True)],
        n=3,
    )
    assert deferred_share(store.routes()) >= 0.99
    routes = {r.name: r.route for r in store.routes()}
    for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"):
        assert routes[f"layer.{name}"] is Route.DEFERRED
    expected = "F.linear" if implementation == "eager" else "grouped_mm"
    assert re.search(rf"layer\.mlp\.experts\.down_proj +{expected}", store.report())
