"""Micro-batch splitting and the layout messages of stage boundaries."""

from __future__ import annotations

import pytest
import torch

from twobp.runtime.communication.tensor_layout import BoundaryMeta, TensorMeta, describe_mismatch
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.execution.microbatch import (
    concat_microbatches,
    flatten,
    microbatch_sizes,
    split_batch,
)


def test_split_and_concat_a_tensor():
    x = torch.arange(12.0).reshape(6, 2)
    parts = split_batch(x, 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert torch.equal(concat_microbatches(parts), x)


def test_split_and_concat_a_tuple():
    ids, mask = torch.arange(8).reshape(4, 2), torch.ones(4, 2, dtype=torch.bool)
    parts = split_batch((ids, mask), 2)
    assert isinstance(parts[1], tuple) and torch.equal(parts[1][0], ids[2:])
    joined = concat_microbatches(parts)
    assert torch.equal(joined[0], ids) and torch.equal(joined[1], mask)


def test_uneven_batches_split_as_tensor_split_does():
    x = torch.arange(22.0).reshape(11, 2)
    for n in (1, 2, 3, 4, 11):
        parts = split_batch((x, x[:, 0]), n)
        expected = torch.tensor_split(x, n)
        assert [p[0].tolist() for p in parts] == [e.tolist() for e in expected]
        assert microbatch_sizes(11, n) == tuple(len(e) for e in expected)
        assert torch.equal(concat_microbatches(parts)[0], x)


def test_split_errors_name_the_sizes():
    with pytest.raises(PipelineConfigError, match=r"batch size 3, fewer rows than the 4 micro"):
        split_batch(torch.zeros(3, 3), 4, "inputs")
    with pytest.raises(PipelineConfigError, match=r"same batch size.*\(4, 1\), \(3, 1\)"):
        split_batch((torch.zeros(4, 1), torch.zeros(3, 1)), 2, "targets")
    with pytest.raises(PipelineConfigError, match="tensor or a tuple of tensors"):
        flatten([torch.zeros(1), "mask"], "the output of stage 1")


def test_layout_message_round_trip():
    meta = BoundaryMeta.of(
        [torch.zeros(2, 3, requires_grad=True), torch.ones(2, dtype=torch.bool)], is_tuple=True
    )
    assert BoundaryMeta.decode(meta.encode()) == meta
    assert meta.gradient == (TensorMeta((2, 3), torch.float32, True),)
    single = BoundaryMeta.of([torch.zeros((), dtype=torch.bfloat16)], is_tuple=False)
    assert BoundaryMeta.decode(single.encode()) == single


def test_layout_message_rejects_garbage_and_overflow():
    with pytest.raises(ValueError, match="not a tensor layout"):
        BoundaryMeta.decode(torch.ones(256, dtype=torch.int64))
    too_many = BoundaryMeta.of([torch.zeros(1, 1, 1, 1)] * 40, is_tuple=True)
    with pytest.raises(ValueError, match="too large"):
        too_many.encode()


def test_describe_mismatch():
    a = TensorMeta((2, 3), torch.float64, True)
    b = TensorMeta((4, 3), torch.float64, True)
    assert describe_mismatch([a], [a]) is None
    assert describe_mismatch([a], [a, a]) == "2 tensors instead of 1"
    assert describe_mismatch([a], [b]) == (
        "tensor 0 is [4, 3] float64, requires grad instead of [2, 3] float64, requires grad"
    )
