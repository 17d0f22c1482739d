"""Mixture-of-experts models of Hugging Face: the routers' auxiliary loss in the pipeline's loss.

Mixtral, Qwen2-MoE (one dense layer among its sparse ones), Qwen3-MoE and OLMoE,
each tiny, float64, with ``output_router_logits`` on, run as a ``Pipeline`` of their
blocks: in a single process world with every block a stage of its own, and on 2
gloo ranks. The reference is the model's own forward (its logits and every layer's
router logits) with its loss computed again in float64: the cross-entropy plus
``router_aux_loss_coef`` times the load-balancing loss written out below, as
``load_balancing_loss_func`` defines it, over the router logits of all layers
concatenated (the model's own loss, which rounds both to float32, agrees to 1e-6).
One micro-batch gives the model's loss over the whole batch; two give the mean of the
model's losses over each micro-batch, which differs (the auxiliary loss is not linear
in the batch).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from runtime_models import needs_no_process_group
from twobp.runtime import Pipeline, launch

transformers = pytest.importorskip("transformers")
from twobp.integrations.transformers import blocks, loss_function  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
VOCAB = 97
EXPERTS, TOP_K, COEF = 4, 2, 0.1
LOSS_TOL = 1e-12
GRAD_TOL = 1e-12
"""|g - g_ref| / max(|g_ref|, 1e-3 |G_ref|) per parameter, G the whole gradient."""


def make_model(kind: str, on: bool = True) -> nn.Module:
    """A tiny float64 model of ``kind`` from a fixed seed, its routers' logits of order 1."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": TOP_K,
        "output_router_logits": on,
        "router_aux_loss_coef": COEF,
        "experts_implementation": "eager",  # grouped_mm takes no float64
    }
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            num_hidden_layers=2, intermediate_size=48, num_local_experts=EXPERTS, **common
        )
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            num_hidden_layers=3,
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=EXPERTS,
            mlp_only_layers=[1],
            **common,
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            num_hidden_layers=2,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=EXPERTS,
            head_dim=8,
            **common,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.OlmoeConfig(
            num_hidden_layers=2, intermediate_size=24, num_experts=EXPERTS, **common
        )
        model = transformers.OlmoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model.double()


def make_batch(rows: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, attention_mask, labels)``; every second row padded on the left, so that
    micro-batches of 2 rows count as many tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (rows, 12), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    mask[1::2, :3] = 0
    labels[1::2, :3] = -100
    return ids, mask, labels


def load_balancing(router_logits: tuple[Tensor, ...], mask: Tensor) -> Tensor:
    """Switch Transformer's load-balancing loss as ``load_balancing_loss_func`` defines it,
    in the logits' dtype: every layer's rows concatenated, padding weighted out."""
    logits = torch.cat(router_logits)
    probs = torch.softmax(logits, dim=-1)
    chosen = nn.functional.one_hot(torch.topk(probs, TOP_K, dim=-1).indices, EXPERTS)
    rows = mask.reshape(-1).repeat(len(router_logits)).to(probs.dtype)
    tokens_per_expert = (chosen * rows[:, None, None]).sum(dim=0) / rows.sum()
    prob_per_expert = (probs * rows[:, None]).sum(dim=0) / rows.sum()
    return EXPERTS * (tokens_per_expert * prob_per_expert).sum()


def model_loss(model: nn.Module, ids: Tensor, mask: Tensor, labels: Tensor) -> Tensor:
    """The model's own loss on its own forward, computed in float64."""
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    ce = nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), shifted.reshape(-1))
    return ce + COEF * load_balancing(out.router_logits, mask)


def reference(kind: str, n_microbatches: int) -> tuple[float, dict[str, Tensor]]:
    """The mean over the micro-batches of the model's own loss, and its gradients named as
    the blocks name them; one micro-batch: over the whole batch."""
    model = make_model(kind)
    ids, mask, labels = make_batch()
    total = torch.zeros((), dtype=torch.float64)
    for part in zip(*(t.chunk(n_microbatches) for t in (ids, mask, labels)), strict=True):
        total = total + model_loss(model, *part) / n_microbatches
    total.backward()
    named = blocks(model).named_parameters()
    return float(total), {n: p.grad for n, p in named if p.grad is not None}


def assert_grads_close(grads: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert set(grads) == set(want)
    whole = torch.cat([g.flatten() for g in want.values()]).norm()
    errors = {
        n: ((grads[n] - g).norm() / max(g.norm(), 1e-3 * whole)).item() for n, g in want.items()
    }
    assert max(errors.values()) <= GRAD_TOL, errors
    routers = [n for n in want if n.endswith("mlp.gate.weight")]
    assert routers and all(want[n].norm() > 0 for n in routers)


def run_pipeline(kind: str, n_microbatches: int, **options: Any) -> dict[str, Any]:
    model = make_model(kind)
    pipe = Pipeline(
        blocks(model), loss_function(model), n_microbatches=n_microbatches, device="cpu", **options
    )
    ids, mask, labels = make_batch()
    loss = pipe.step((ids, mask), labels)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    return {"loss": loss, "grads": grads}


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_give_the_model_s_own_loss_with_its_routers_aux_loss(kind):
    model = make_model(kind)
    ids, mask, labels = make_batch(2)
    loss = loss_function(model)(blocks(model)((ids, mask)), labels)
    want = model_loss(model, ids, mask, labels)
    assert math.isclose(loss.item(), want.item(), rel_tol=0, abs_tol=LOSS_TOL)
    own = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert math.isclose(
        own.aux_loss.item(), load_balancing(own.router_logits, mask).item(), rel_tol=1e-6
    )
    assert math.isclose(loss.item(), own.loss.item(), rel_tol=1e-6)

    # Off: the model's own loss leaves the aux loss out, and so do the blocks.
    model.config.output_router_logits = False
    plain = loss_function(model)(blocks(model)((ids, mask)), labels)
    own = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert own.aux_loss is None
    assert math.isclose(plain.item(), own.loss.item(), rel_tol=1e-6)
    assert loss.item() - plain.item() > COEF  # times the aux loss, about top_k or more


@needs_no_process_group
@pytest.mark.parametrize("n_microbatches", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_one_process_every_block_a_stage_equals_the_model(kind, n_microbatches):
    n_blocks = len(blocks(make_model(kind)))
    got = run_pipeline(
        kind,
        n_microbatches,
        schedule="interleaved-1f1b",
        stages_per_rank=n_blocks,
        partition=[1] * n_blocks,
        two_bp=True,
    )
    want_loss, want_grads = reference(kind, n_microbatches)
    assert math.isclose(got["loss"], want_loss, rel_tol=0, abs_tol=LOSS_TOL), got["loss"]
    assert_grads_close(got["grads"], want_grads)
    if n_microbatches > 1:  # the mean over micro-batches is not the whole batch's
        whole, _ = reference(kind, 1)
        assert abs(got["loss"] - whole) > 1e-6


CASES = [
    *[(kind, "1f1b", True, 1) for kind in KINDS],
    ("mixtral", "zb-h1", True, 2),
    ("qwen2_moe", "gpipe", False, 2),
]


def _session() -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {}
    for kind, schedule, two_bp, n_mb in CASES:
        got = run_pipeline(kind, n_mb, schedule=schedule, two_bp=two_bp, timeout=60.0)
        out[str((kind, schedule, two_bp, n_mb))] = got
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return launch(_session, 2, threads_per_rank=1, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_two_ranks_equal_the_model(case, per_rank):
    kind, _, _, n_mb = case
    want_loss, want_grads = reference(kind, n_mb)
    grads: dict[str, Tensor] = {}
    for rank, result in enumerate(r[str(case)] for r in per_rank):
        assert math.isclose(result["loss"], want_loss, rel_tol=0, abs_tol=LOSS_TOL), rank
        assert result["grads"], f"rank {rank} holds no parameters"
        assert not set(grads) & set(result["grads"])
        grads.update(result["grads"])
    assert_grads_close(grads, want_grads)


def test_an_aux_loss_twobp_cannot_compute_is_refused():
    torch.manual_seed(0)
    config = transformers.PhimoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        output_router_logits=True,
        experts_implementation="eager",
    )
    model = transformers.PhimoeForCausalLM(config)
    refused = "cannot add the routers' auxiliary loss \\(aux_loss\\) of a PhimoeForCausalLM"
    with pytest.raises(ValueError, match=refused):
        loss_function(model)
    with pytest.raises(ValueError, match=refused):
        blocks(model)
    # Without it in its own loss, nothing is left out: the blocks give the logits.
    model.config.output_router_logits = False
    ids, _, labels = make_batch(2)
    logits = blocks(model)(ids)
    assert logits.shape == (2, 12, VOCAB)
    assert loss_function(model)(logits, labels).isfinite()


def test_the_loss_refuses_an_output_made_under_the_other_setting():
    model = make_model("mixtral")
    ids, _, labels = make_batch(2)
    model.config.output_router_logits = False
    logits = blocks(model)(ids)
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match=r"takes the last block's \(logits, probs, counts\)"):
        loss_function(model)(logits, labels)
    routed = blocks(model)(ids)
    assert isinstance(routed, tuple) and len(routed) == 3
    model.config.output_router_logits = False
    with pytest.raises(ValueError, match="adds no routers' auxiliary loss, so it takes the logits"):
        loss_function(model)(routed, labels)
