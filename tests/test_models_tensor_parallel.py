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


def test_a_hugging_face_plan_entry_outside_the_decoder_linears_is_refused_naming_it():
    hf = pytest.importorskip("twobp.integrations.transformers")
    pytest.importorskip("transformers")
    model = hf.build_model("llama")
    model.config.base_model_tp_plan = {"embed_tokens": "embedding"}
    with pytest.raises(ValueError, match="the entry 'embed_tokens': 'embedding' of"):
        hf.tensor_parallel_plan(model)
    model.config.base_model_tp_plan = None
    with pytest.raises(ValueError, match="has no base_model_tp_plan; pass a plan of your own"):
        hf.tensor_parallel_plan(model)
