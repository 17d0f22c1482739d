"""Pipelines of tensor-parallel blocks equal one process on the whole model (float64, gloo)."""

from __future__ import annotations

import pytest

from tensor_parallel_pipeline_workers import overflow_agreed, parity, refusal
from twobp.runtime.launch import launch

SCHEDULES = ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v"]
TOLERANCE = 1e-10


def _check(
    results: list[list[dict]],
    cases: list,
    tensor_parallel: int,
    split_per_rank: int = 0,
    tolerance: dict[str, float] | None = None,
) -> None:
    tolerance = {key: TOLERANCE for key in ("loss", "gradients", "parameters", "norm")} | (
        tolerance or {}
    )
    for rank_results in results:
        assert len(rank_results) == len(cases)
        for case, errors in zip(cases, rank_results, strict=True):
            assert errors["tp_size"] == tensor_parallel
            for key in ("loss", "gradients", "parameters", "norm"):
                assert errors[key] < tolerance[key], (case, key, errors)
            assert errors["memory"] == 0, errors  # memory_stats counts the local shards
            assert errors["deferred"] in (None, 1.0), errors  # W adds every weight, shards too
    for i, case in enumerate(cases):
        # Each of the 4 decoders' 7 linears is split, on every tensor-parallel rank of
        # every copy (case[2] copies), and split_per_rank more (embedding, head) on each rank.
        split = sum(rank_results[i]["sharded"] for rank_results in results)
        if case[1] and case[0] == "1f1b":  # every stage splits its backward
            assert all(r[i]["deferred"] == 1.0 for r in results), case
        assert split == 7 * 4 * tensor_parallel * case[2] + split_per_rank * len(results), case


def test_two_ranks_split_every_block_in_two():
    cases = [("1f1b", True, 1), ("1f1b", False, 1)]
    _check(launch(parity, 2, cases, 2, timeout=300), cases, 2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_pipeline_ranks_of_two_tensor_parallel_ranks(schedule):
    cases = [(schedule, True, 1), (schedule, False, 1)]
    results = launch(parity, 4, cases, 2, timeout=300)
    _check(results, cases, 2)
    assert [r[0]["tp_rank"] for r in results] == [0, 1, 0, 1]  # tensor parallel innermost


def test_data_parallel_copies_of_a_tensor_parallel_pipeline():
    cases = [("1f1b", True, 2)]
    _check(launch(parity, 8, cases, 2, timeout=300), cases, 2)


def test_a_sharded_optimizer_over_the_copies_of_a_tensor_parallel_pipeline():
    # D 2 x P 1 x T 2: AdamW's state of each shard sharded over its 2 copies (never over tp).
    cases = [("1f1b", True, 2)]
    _check(launch(parity, 4, cases, 2, True, timeout=300), cases, 2)


def test_a_head_tied_across_pipeline_ranks_to_a_vocabulary_split_embedding():
    # P 2 x T 2: the embedding (first stage) and the head (last stage) share one weight,
    # split by vocabulary rows; each shard's tie is reduced within its own pipeline.
    cases = [("1f1b", True, 1), ("1f1b", False, 1), ("zb-h1", True, 1)]
    results = launch(parity, 4, cases, 2, False, "tied", timeout=300)
    _check(results, cases, 2, split_per_rank=1)  # the tied shard, on each rank


def test_an_untied_head_split_by_columns_gathers_its_logits():
    cases = [("1f1b", True, 1)]
    _check(launch(parity, 2, cases, 2, False, "split", timeout=300), cases, 2, split_per_rank=2)


@pytest.mark.parametrize("dims", [("dp", "pp", "tp"), ("pp", "tp")])
def test_a_device_mesh_with_a_tp_dim_lays_out_the_ranks(dims):
    # init_device_mesh(..., mesh_dim_names=dims) in place of data_parallel and
    # tensor_parallel: D 2 x P 1 x T 2, or P 2 x T 2.
    cases = [("1f1b", True, 2 if "dp" in dims else 1)]
    results = launch(parity, 4, cases, 2, False, "whole", False, dims, timeout=300)
    _check(results, cases, 2)
    assert [r[0]["tp_rank"] for r in results] == [0, 1, 0, 1]  # tensor parallel innermost


def test_compiled_stages_run_the_collectives_between_their_compiled_regions():
    # compile=True: each collective of the split modules (an all-reduce, the gather of a
    # split head) is a graph break, and the regions between them compile. Inductor's
    # float64 kernels differ from eager ones (the gradients by some 1e-9, the losses by
    # 1e-7, which AdamW's steps make some 1e-5 in the parameters), as they do without
    # tensor parallelism; a missing or doubled collective is off by far more.
    cases = [("1f1b", True, 1), ("zb-h1", True, 1)]
    results = launch(parity, 4, cases, 2, False, "split", True, timeout=300)
    loose = {"loss": 1e-6, "gradients": 1e-8, "parameters": 1e-4, "norm": 1e-6}
    _check(results, cases, 2, split_per_rank=1, tolerance=loose)


def test_dynamic_w_may_run_while_the_all_reduce_of_i_is_in_flight():
    # Stored W run a layer at a time while a column-parallel linear's input gradient is
    # all-reduced (how many depends on the timing): equal to one process whatever ran there.
    cases = [("1f1b", "dynamic", 1)]
    results = launch(parity, 4, cases, 2, False, "tied", timeout=300)
    _check(results, cases, 2, split_per_rank=1)
    assert all(r[0]["reducing"] > 0 for r in results)  # every rank timed its all-reduces


def test_an_overflow_in_one_shard_skips_the_step_on_every_rank():
    for unchanged, backed_off in launch(overflow_agreed, 2, timeout=300):
        assert unchanged and backed_off


@pytest.mark.parametrize(
    ("case", "ranks", "words"),
    [
        ("world", 2, "a world of 2 ranks is not data_parallel x pipeline x 3 ranks"),
        ("no module", 2, "'attn.wqkv' names no module of any block"),
        ("heads", 2, "has 1 heads, which do not divide by 2 ranks"),
        ("vocabulary", 2, "block 0: tensor parallel: embed (embedding_rowwise) has a vocabulary"),
        ("embedding columns", 2, "an embedding splits only by vocabulary rows"),
        ("tied two ways", 2, "block 5's output.weight (Linear) is the weight of block 0's embed"),
        ("auto", 2, "schedule='auto' plans from what each tensor-parallel pipeline"),
        ("checkpoint", 2, "state_dict() of a tensor-parallel pipeline is refused"),
        ("torch styles", 2, "accepted"),
        ("sequence parallel", 2, "'attn_norm': SequenceParallel with input layouts"),
        ("mesh layout", 4, "twobp lays them out dp x pp x tp with tp innermost"),
        ("mesh size", 4, "tensor_parallel=4 but the mesh {'pp': 2, 'tp': 2} says 2"),
        ("mesh of copies", 4, "with a mesh= of dims ('dp', 'pp'): give a mesh with dims"),
        ("sizes differ", 2, "other tensor_parallel sizes (rank 0: 2, rank 1: 1; none counts"),
    ],
)
def test_bad_input_is_refused_in_one_line_on_every_rank(case, ranks, words):
    messages = launch(refusal, ranks, case, timeout=300)
    assert all(words in m and "\n" not in m for m in messages), messages


@pytest.mark.parametrize(
    ("schedule", "ranks", "tied", "loss_parallel"),
    [
        ("1f1b", 2, False, False),
        ("zb-h1", 4, False, False),
        ("1f1b", 2, True, False),
        ("zb-h1", 4, True, False),
        ("1f1b", 4, True, True),
        ("zb-h1", 2, False, True),
    ],
)
def test_a_hugging_face_llama_split_by_its_own_plan(schedule, ranks, tied, loss_parallel):
    # The decoders, the embedding by vocabulary and the head by columns, as the model's
    # plan says; a tied head (tie_word_embeddings) on the last stage reads the first's shard.
    pytest.importorskip("transformers")
    from tensor_parallel_pipeline_workers import hugging_face

    results = launch(hugging_face, ranks, schedule, tied, loss_parallel, timeout=300)
    for errors in results:
        assert errors["loss"] < TOLERANCE and errors["parameters"] < TOLERANCE, errors
    # 7 linears of each of the 2 decoders on each of the 2 tensor-parallel ranks; the
    # embedding and the head on each too, one weight where tied on one stage.
    vocabulary = 1 if tied and ranks == 2 else 2
    assert sum(e["sharded"] for e in results) == 7 * 2 * 2 + vocabulary * 2


def test_a_checkpoint_saved_split_loads_whole_and_split_again(tmp_path):
    from tensor_parallel_pipeline_workers import checkpoint_across

    for errors in launch(checkpoint_across, 4, str(tmp_path), timeout=300):
        assert errors["loss"] < TOLERANCE and errors["parameters"] < TOLERANCE, errors
