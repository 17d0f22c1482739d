"""Hugging Face models cut into blocks: the model's own outputs and loss, and 2BP gradients.

Each family is built from a small configuration (no download). The blocks run
as a pipeline would run them on one process: one store per block, the
forwards of every micro-batch, their input passes in reverse, one weight pass
over all. Every gradient is compared with the model's own backward, per
parameter against the larger of its own norm and 1e-3 of the whole gradient's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from twobp.engine import WeightGradStore, defer_weight_grads
from twobp.engine.coverage import deferred_share

transformers = pytest.importorskip("transformers")
from twobp.integrations.transformers import (  # noqa: E402
    FAMILIES,
    SIZES,
    blocks,
    build_model,
    family,
    loss_function,
    n_blocks,
)

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    # The reference implementations fall back to plain torch and say so.
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

VOCAB = SIZES["tiny"]["vocab_size"]
COVERAGE = {"llama": 0.99, "gpt2": 0.99, "bert": 0.99, "mamba": 0.93}
"""The share of weight elements whose gradient W adds in full, at least."""


def make_model(kind: str) -> nn.Module:
    """A tiny model of the family, from a fixed seed."""
    torch.manual_seed(0)
    return build_model(kind, "tiny")


def micro_batches(n: int, padded: bool) -> list[tuple[Tensor, Tensor | None, Tensor]]:
    """``(input_ids, attention_mask, labels)`` per micro-batch; padded: one row's first tokens
    (padding on the left: causal attention would never see padding on the right)."""
    out = []
    for mb in range(n):
        g = torch.Generator().manual_seed(mb)
        ids = torch.randint(1, VOCAB, (2, 12), generator=g)
        labels = ids.clone()
        mask = None
        if padded:
            mask = torch.ones_like(ids)
            mask[1, :3] = 0
            labels[1, :3] = -100
        out.append((ids, mask, labels))
    return out


def _leaf(x: Any) -> Any:
    """What a next stage receives: the hidden states as a leaf, the mask as it is."""
    if isinstance(x, tuple):
        return (x[0].detach().requires_grad_(), x[1])
    return x.detach().requires_grad_(x.is_floating_point())


def _first(x: Any) -> Tensor:
    return x[0] if isinstance(x, tuple) else x


def two_bp_step(
    model: nn.Module, batches: list[tuple[Tensor, Tensor | None, Tensor]], dtype: torch.dtype | None
) -> list[WeightGradStore]:
    """One training step of ``model``'s blocks under the engine (each block its own stage)."""
    parts = blocks(model)
    stores = [defer_weight_grads(b, label=f"block {i}") for i, b in enumerate(parts)]
    loss_fn = loss_function(model)
    n = len(batches)
    cast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    ran: dict[int, list[tuple[Any, Tensor]]] = {}
    for mb, (ids, mask, labels) in enumerate(batches):
        x: Any = ids if mask is None else (ids, mask)
        ran[mb] = []
        for i, (block, store) in enumerate(zip(parts, stores, strict=True)):
            leaf = x if i == 0 else _leaf(x)
            with cast, store.forward(mb):
                y = block(leaf)
                out = loss_fn(y, labels) / n if i == len(parts) - 1 else _first(y)
            ran[mb].append((leaf, out))
            x = y
    for mb in reversed(range(n)):
        grad = None
        for i in reversed(range(len(parts))):
            leaf, out = ran[mb][i]
            inputs = [] if i == 0 else [_first(leaf)]
            got = stores[i].backward_input(mb, [out], [grad], inputs)
            grad = got[0] if inputs else None
    for store in stores:
        store.backward_weight(range(n))
        store.finish_step()
    return stores


def reference_step(
    model: nn.Module, batches: list[tuple[Tensor, Tensor | None, Tensor]], dtype: torch.dtype | None
) -> None:
    """The same step on the whole model and plain autograd (its loss kept in float64)."""
    cast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    loss_fn = loss_function(model)
    for ids, mask, labels in batches:
        with cast:
            loss = loss_fn(model_logits(model, ids, mask), labels)
        (loss / len(batches)).backward()


def model_logits(model: nn.Module, ids: Tensor, mask: Tensor | None) -> Tensor:
    """The model's logits; Mamba's in float64 too (its own forward rounds them to float32)."""
    hf: Any = model
    if family(model) == "mamba":
        hidden = hf.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        logits: Tensor = hf.lm_head(hidden.to(hf.lm_head.weight.dtype))
        return logits if logits.dtype == torch.float64 else logits.float()
    out: Tensor = model(input_ids=ids, attention_mask=mask).logits
    return out


def relative_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Per parameter: |g - g_ref| / max(|g_ref|, 1e-3 |G_ref|), G the whole gradient."""
    total = torch.cat([q.grad.double().flatten() for q in reference.parameters()]).norm()
    errors = {}
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        diff = (p.grad.double() - q.grad.double()).norm()
        errors[name] = (diff / max(q.grad.double().norm(), 1e-3 * total)).item()
    return errors


def coverage(stores: list[WeightGradStore]) -> float:
    """The share of weight elements deferred in full, over the blocks (a tied weight once)."""
    routes = {}
    for store in stores:
        for route in store.routes():
            kept = routes.get(id(route.parameter))
            if kept is None or kept.route.value != "deferred":
                routes[id(route.parameter)] = route
    return deferred_share(tuple(routes.values()))


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("padded", [False, True])
def test_blocks_compute_the_model_s_logits_and_loss(kind, padded):
    model = make_model(kind).double()
    parts = blocks(model)
    loss_fn = loss_function(model)
    assert family(model) == kind
    for ids, mask, labels in micro_batches(2, padded):
        logits = parts(ids if mask is None else (ids, mask))
        own = model(input_ids=ids, attention_mask=mask, labels=labels)
        keep = slice(None) if mask is None else mask.bool()  # padded positions are not compared
        exact = model_logits(model, ids, mask)
        torch.testing.assert_close(logits[keep], exact[keep], rtol=0, atol=1e-10)
        torch.testing.assert_close(logits.to(own.logits.dtype), own.logits, rtol=1e-6, atol=1e-6)
        loss = loss_fn(logits, labels)
        # The model's own causal loss rounds the logits to float32; this one keeps float64.
        torch.testing.assert_close(loss, own.loss.to(loss.dtype), rtol=1e-6, atol=0)
        torch.testing.assert_close(loss, loss_fn(exact, labels), rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", FAMILIES)
def test_two_bp_equals_the_model_in_one_process_float64(kind):
    model = make_model(kind).double()
    reference = copy.deepcopy(model)
    batches = micro_batches(3, padded=True)
    two_bp_step(model, batches, None)
    reference_step(reference, batches, None)
    errors = relative_errors(model, reference)
    assert max(errors.values()) <= 1e-10, errors


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize(("dtype", "tolerance"), [(None, 1e-5), (torch.bfloat16, 2e-2)])
def test_float32_and_bf16_autocast_gradients_and_coverage(kind, dtype, tolerance):
    model = make_model(kind)
    reference = copy.deepcopy(model)
    batches = micro_batches(2, padded=False)
    stores = two_bp_step(model, batches, dtype)
    reference_step(reference, batches, dtype)
    errors = relative_errors(model, reference)
    assert max(errors.values()) <= tolerance, errors
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert coverage(stores) >= COVERAGE[kind]


def test_gpt2_block_report():
    model = make_model("gpt2")
    parts = blocks(model)
    store = defer_weight_grads(parts[1], label="gpt2 block 1")
    x = torch.randn(2, 12, 64, requires_grad=True)
    with store.forward(0):
        y = parts[1](x)
    report = store.report()
    assert report.startswith("2BP weight gradients of gpt2 block 1: 12 deferred, 0 immediate")
    assert "block.attn.c_attn.weight  torch.addmm in Conv1D 'block.attn.c_attn'" in report
    assert "block.ln_1.weight         F.layer_norm in LayerNorm 'block.ln_1'" in report
    store.backward_input(0, [y], [torch.ones_like(y)], [x])
    store.backward_weight([0])
    store.finish_step()


def test_a_model_of_another_layout_is_refused():
    with pytest.raises(ValueError, match="does not know how to cut a Linear"):
        blocks(nn.Linear(2, 2))


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("kind", FAMILIES)
def test_n_blocks_counts_the_blocks_of_a_built_model(kind, size):
    assert n_blocks(size) == len(blocks(build_model(kind, size)))


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_forward_through_the_blocks_warns_of_nothing_twobp_passes(kind):
    # The mask builders take the cache under its new name only: passing the deprecated
    # one too made transformers warn on every Hugging Face run.
    model = make_model(kind).double()
    parts = blocks(model)
    ids, mask, _ = micro_batches(1, True)[0]
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parts((ids, mask))
    ours = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]


def test_an_encoder_decoder_is_refused_with_the_way_to_write_its_blocks():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8
    )
    with pytest.raises(ValueError, match="T5ForConditionalGeneration") as info:
        blocks(transformers.T5ForConditionalGeneration(config))
    assert "write its blocks yourself" in str(info.value)
    assert "\n" not in str(info.value)
