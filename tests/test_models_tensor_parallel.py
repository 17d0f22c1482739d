"""A block split by a tensor-parallel plan equals the whole block on real gloo ranks."""

from __future__ import annotations

import pytest

from tensor_parallel_workers import (
    block_errors,
    deferred_errors,
    hugging_face_errors,
    input_reductions,
    refusal,
)
from twobp.models import tensor_parallel_plan
from twobp.runtime.launch import launch


def test_a_sharded_llama_block_gives_the_whole_blocks_output_and_gradients():
    for errors in launch(block_errors, 2, timeout=120):
        assert len(errors) == 2 + 9  # output, input gradient, 9 parameters
        assert max(errors.values()) < 1e-10, errors


def test_the_linears_that_read_one_input_all_reduce_its_gradient_once():
    # q, k and v read one tensor, and so do a SwiGLU's w1 and w3: 2 all-reduces a layer, not 5.
    for counts in launch(input_reductions, 2, timeout=120):
        assert counts["llama"] == 2, counts
        assert counts.get("hugging face", 2) == 2, counts


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("heads", "attn has 3 heads, which do not divide by 2 ranks"),
        ("no module", "'attn.wqkv' names no module of the block"),
        ("width", "mlp.w2 (rowwise) has width 25, which does not divide by 2 ranks"),
    ],
)
def test_bad_plans_and_shapes_are_refused_on_every_rank_naming_the_module(case, words):
    messages = launch(refusal, 2, case, timeout=120)
    assert all(words in m and "\n" not in m for m in messages), messages


def test_a_model_without_a_plan_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="no plan ships for 'bert'; known: 'llama'"):
        tensor_parallel_plan("bert")


def test_the_2bp_engine_defers_the_local_weight_gradients_of_a_sharded_block():
    for result in launch(deferred_errors, 2, timeout=120):
        assert result["held back"] == 1.0  # no sharded weight had a gradient after I
        assert result["share"] >= 0.99, result
        assert result["gradients"] < 1e-10, result


def test_a_hugging_face_llama_layer_split_by_its_own_plan_equals_the_whole_layer():
    pytest.importorskip("transformers")
    assert max(launch(hugging_face_errors, 2, timeout=120)) < 1e-10


def test_a_hugging_face_plan_entry_twobp_does_not_split_is_refused_naming_it(monkeypatch):
    hf = pytest.importorskip("twobp.integrations.transformers")
    pytest.importorskip("transformers")
    model = hf.build_model("llama")
    model._tp_plan = {**model._tp_plan, "model.embed_tokens": "embedding_colwise"}
    with pytest.raises(ValueError, match=r"'model\.embed_tokens': 'embedding_colwise' of Llama"):
        hf.tensor_parallel_plan(model)
    for pattern in ("model.layers.*.nothing", "model"):  # none; one the blocks leave out
        model._tp_plan = {pattern: "colwise"}
        with pytest.raises(ValueError, match=f"'{pattern}': 'colwise' of .* names no module"):
            hf.tensor_parallel_plan(model)
    model._tp_plan = {"model.layers.*.self_attn.q_proj": "colwise"}
    with pytest.raises(ValueError, match="loss_parallel=True, but LlamaForCausalLM's plan has"):
        hf.tensor_parallel_plan(model, loss_parallel=True)
    model._tp_plan = None
    monkeypatch.setattr(type(model), "_tp_plan", None)
    model.config.base_model_tp_plan = None
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        hf.tensor_parallel_plan(model)


def test_a_hugging_face_plan_names_the_modules_inside_the_blocks():
    hf = pytest.importorskip("twobp.integrations.transformers")
    pytest.importorskip("transformers")
    model = hf.build_model("llama")
    plan = hf.tensor_parallel_plan(model)
    assert plan["head"] == "colwise_gather_output" and plan["embedding"] == "embedding_rowwise"
    assert plan["layer.self_attn.q_proj"] == "colwise"
    assert plan["layer.mlp.down_proj"] == "rowwise"
    assert hf.tensor_parallel_plan(model, loss_parallel=True)["head"] == "colwise_loss_parallel"
    assert "head" not in hf.tensor_parallel_plan(model, vocabulary=False)
    model._tp_plan = {"lm_head": "colwise_rep", "model.norm": "replicate"}  # transformers 4
    assert hf.tensor_parallel_plan(model) == {"head": "colwise_gather_output"}
