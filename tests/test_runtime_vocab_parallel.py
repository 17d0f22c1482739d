"""The vocabulary-parallel cross-entropy: on shards of the logits, equal to F.cross_entropy of
the whole ones, alone and as a pipeline's loss (float64, gloo)."""

from __future__ import annotations

import pytest
import torch

from tensor_parallel_pipeline_workers import parity
from test_runtime_tensor_parallel import _check
from twobp.models.tensor_parallel import vocab_parallel_cross_entropy
from twobp.runtime.launch import launch
from vocab_parallel_workers import (
    function_errors,
    in_loss_parallel,
    pipeline_refusal,
    vocabulary_tensors,
)

TOLERANCE = 1e-10


@pytest.mark.parametrize("class_weights", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_loss_of_the_shards_equals_the_cross_entropy_of_the_whole_logits(
    reduction, smoothing, class_weights
):
    # Logits near 800 (exp overflows without the max), ignored targets, targets on both ranks;
    # label smoothing and class weights as F.cross_entropy's (1.0: the uniform target alone).
    for errors in launch(function_errors, 2, reduction, smoothing, class_weights, timeout=120):
        assert errors["finite"] == 1.0, errors
        assert errors["loss"] < TOLERANCE and errors["gradient"] < TOLERANCE, errors


@pytest.mark.parametrize("case", ["hugging face", "masked rows", "smoothing", "class weights"])
def test_a_loss_written_for_whole_logits_runs_on_the_shards(case):
    assert all(error < TOLERANCE for error in launch(in_loss_parallel, 2, case, timeout=120))


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("softmax", "the loss applied log_softmax to logits split by vocabulary"),
        ("vocabulary flattened", "the loss applied reshape to logits split by vocabulary"),
        ("unmarked", "F.cross_entropy of logits that are not the output of the head"),
        ("three dims", "takes logits of 3 dims"),
        ("deprecated reduce", "takes reduce"),
        ("weights of a part", "give one floating-point weight per id of the whole vocabulary"),
    ],
)
def test_what_would_read_part_of_the_vocabulary_as_the_whole_is_refused(case, words):
    messages = launch(in_loss_parallel, 2, case, timeout=120)
    assert all(words in m and "\n" not in m for m in messages), messages


def test_two_tensor_parallel_ranks_train_through_the_split_logits():
    # T 2: embedding split by vocabulary, the head by columns, its logits never gathered;
    # the head's W deferred as any linear's (1f1b), ignored targets in every micro-batch.
    cases = [("1f1b", True, 1), ("zb-h1", True, 1)]
    results = launch(parity, 2, cases, 2, False, "loss_parallel", timeout=300)
    _check(results, cases, 2, split_per_rank=2)


def test_a_label_smoothed_loss_trains_through_the_split_logits():
    cases = [("1f1b", True, 1)]
    results = launch(parity, 2, cases, 2, False, "smoothed_loss_parallel", timeout=300)
    _check(results, cases, 2, split_per_rank=2)


def test_a_head_tied_across_pipeline_ranks_trains_through_the_split_logits():
    # P 2 x T 2: the head on the last stage reads the first stage's embedding shard; W run
    # where the dynamic policy places them too.
    cases = [("1f1b", True, 1), ("zb-h1", True, 1), ("1f1b", "dynamic", 1)]
    results = launch(parity, 4, cases, 2, False, "tied_loss_parallel", timeout=300)
    _check(results, cases, 2, split_per_rank=1)


def test_no_rank_makes_a_tensor_of_the_whole_vocabulary():
    gathered = launch(vocabulary_tensors, 2, "split", timeout=300)
    split = launch(vocabulary_tensors, 2, "loss_parallel", timeout=300)
    assert all(r["whole"] > 0 for r in gathered), gathered  # the check sees gathered logits
    assert all(r["whole"] == 0 and r["part"] > 0 for r in split), split


@pytest.mark.parametrize(
    ("case", "ranks", "words"),
    [
        ("not cross-entropy", 2, "the loss applied pow to logits split by vocabulary"),
        ("not cross-entropy", 4, "the loss applied pow to logits split by vocabulary"),
        ("no cross-entropy", 2, "the loss computed no F.cross_entropy of them"),
        ("early head", 2, "only the last block's head may have it, not block 1's attn.wq"),
    ],
)
def test_a_split_head_misused_is_refused_in_one_line_on_every_rank(case, ranks, words):
    messages = launch(pipeline_refusal, ranks, case, timeout=120)
    assert all(words in m and "\n" not in m for m in messages), messages


def test_torch_s_column_parallel_head_with_its_logits_left_split_is_the_loss_parallel_style():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    from twobp.runtime.setup.tensor_parallel import style_name

    assert style_name("output", ColwiseParallel(use_local_output=False)) == "colwise_loss_parallel"
    assert style_name("output", ColwiseParallel()) == "colwise"
    gathered = ColwiseParallel(output_layouts=Replicate())
    assert style_name("output", gathered) == "colwise_gather_output"


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"label_smoothing": 1.5}, r"label_smoothing=1\.5; give a number between 0\.0 and 1\.0"),
        (
            {"weight": torch.ones(6, requires_grad=True)},
            r"class weights require grad.*pass weight\.detach\(\)",
        ),
    ],
)
def test_bad_arguments_are_refused_before_any_collective(given, words):
    logits, targets = torch.zeros(4, 6), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=words):
        vocab_parallel_cross_entropy(logits, targets, None, **given)
