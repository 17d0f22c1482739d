"""The bench's torch.distributed.pipelining variants: which layouts they refuse, and their
gradients against the single-process model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from twobp.models import build_model
from twobp_bench import matrix
from twobp_bench.matrix import Variant
from twobp_bench.torch_pipelining import TorchRunner, tie_refusal


def _layout(family: str, schedule: str, n_ranks: int) -> tuple[list, tuple[int, ...], tuple]:
    spec = build_model(family, "tiny", n_layers=2)
    variant = Variant(matrix.TORCH, schedule)
    stage_ranks = matrix.placement(variant, n_ranks)
    kinds = [k.value for k in spec.block_kinds]
    partition = matrix.stage_partition(kinds, matrix.model_stages(variant, n_ranks))
    return spec.blocks, partition, stage_ranks


def test_a_weight_tied_across_ranks_is_refused_with_its_names():
    # BERT ties the decoder to the word embedding: the first and last stage, on
    # two ranks under 1F1B, share one parameter.
    reason = tie_refusal(*_layout("bert", "1F1B", 2))
    assert reason is not None
    assert "0.word.weight and 3.decoder.weight are one tied weight on ranks 0, 1" in reason
    assert "does not sum their gradients" in reason
    assert tie_refusal(*_layout("mamba", "Interleaved1F1B", 2)) is not None
    # The V placement puts the first and the last stage on rank 0: one object there.
    assert tie_refusal(*_layout("bert", "ZBVZeroBubble", 2)) is None
    assert tie_refusal(*_layout("llama", "1F1B", 2)) is None


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_stages_on_one_rank_share_a_tied_weight_and_name_it_once(one_rank_group):
    spec = build_model("bert", "tiny", n_layers=2, dtype=torch.float64)
    variant = Variant(matrix.TORCH, "ZBVZeroBubble")
    _, partition, _ = _layout("bert", "ZBVZeroBubble", 1)
    inputs, targets = spec.make_batch(4, 0)
    runner = TorchRunner(
        variant,
        copy.deepcopy(spec.blocks),
        spec.loss_fn,
        2,
        partition,
        inputs,
        targets,
        rank=0,
        n_ranks=1,
        device=torch.device("cpu"),
    )
    runner.step()
    reference = spec.sequential()
    for half in (slice(0, 2), slice(2, 4)):
        (spec.loss_fn(reference(inputs[half]), targets[half]) / 2).backward()
    want = dict(reference.named_parameters())
    got = dict(runner.named_parameters())
    assert list(got) == list(want)
    for name, p in got.items():
        torch.testing.assert_close(p.grad, want[name].grad, msg=name)
