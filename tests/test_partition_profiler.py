"""The block profiler on tiny reference models: positive costs, no side effects."""

import pytest
import torch

from twobp.models import build_model
from twobp.partition import solve
from twobp.partition.profiler import profile_blocks, solver_costs, solver_memory
from twobp.sim.from_profile import stage_cost_model


@pytest.fixture(scope="module")
def llama_costs():
    spec = build_model("llama", "tiny", n_layers=2)
    return spec, profile_blocks(spec.blocks, spec.example_input(2), repeats=2)


def test_every_block_of_tiny_llama_has_positive_costs(llama_costs):
    spec, costs = llama_costs
    assert [c.index for c in costs] == list(range(spec.n_blocks))
    assert [c.name for c in costs] == ["TokenEmbedding", "DecoderBlock", "DecoderBlock", "LMHead"]
    for c in costs:
        assert c.forward > 0 and c.backward_input > 0 and c.backward_weight > 0, c
        assert c.backward_full > 0
        assert c.total == c.forward + c.backward_input + c.backward_weight
        assert c.weight_grad_bytes > 0 and c.parameter_bytes > 0
    hidden = 2 * 32 * 64 * 4  # batch x seq x dim, float32
    assert [c.output_bytes for c in costs] == [hidden, hidden, hidden, 2 * 32 * 256 * 4]
    # A decoder block keeps its input and more for the backward.
    assert costs[1].activation_bytes > hidden
    assert costs[1].parameter_bytes == 4 * sum(p.numel() for p in spec.blocks[1].parameters())


def test_costs_feed_the_solver_and_the_simulator(llama_costs):
    _, costs = llama_costs
    partition = solve(solver_costs(costs), 2, memory=solver_memory(costs, in_flight=2))
    assert sum(partition.sizes) == 4
    model = stage_cost_model(costs, partition.sizes, meta={"model": "llama-tiny"})
    assert model.n_stages == 2
    assert sum(model.forward) == pytest.approx(sum(c.forward for c in costs))
    assert model.send_bytes[0] == costs[partition.sizes[0] - 1].output_bytes
    with pytest.raises(ValueError, match="covers 3 blocks"):
        stage_cost_model(costs, [1, 2])


def test_profiling_leaves_gradients_and_buffers_as_they_were():
    spec = build_model("resnet", "tiny", layers=(1,))
    before = [b.clone() for block in spec.blocks for b in block.buffers()]
    weights = [p.clone() for block in spec.blocks for p in block.parameters()]
    profile_blocks(spec.blocks, spec.example_input(2), repeats=1, warmup=0)
    after = [b for block in spec.blocks for b in block.buffers()]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    params = [p for block in spec.blocks for p in block.parameters()]
    assert all(p.grad is None for p in params)
    assert all(torch.equal(x, y) for x, y in zip(weights, params, strict=True))
    # The blocks run as before: no patch of the engine is left behind.
    spec.sequential()(spec.example_input(2)).sum().backward()


def test_tuple_inputs_are_profiled():
    spec = build_model("bert", "tiny", n_layers=1)
    ids = spec.example_input(2)
    costs = profile_blocks(spec.blocks, (ids, torch.zeros_like(ids)), repeats=1, warmup=0)
    assert len(costs) == 3 and all(c.total > 0 for c in costs)


def test_bad_repeats_are_rejected():
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile_blocks([], torch.zeros(1), repeats=0)


def test_a_grouped_w_is_timed_for_every_count_and_leaves_the_blocks_as_they_were():
    from twobp.partition.profiler import weight_group_times

    spec = build_model("llama", "tiny", n_layers=1)
    tables = weight_group_times(spec.blocks, spec.example_input(2), [1, 2, 4])
    assert len(tables) == len(spec.blocks)
    assert all(set(t) == {1, 2, 4} and min(t.values()) >= 0 for t in tables)
    assert all(p.grad is None for b in spec.blocks for p in b.parameters())
    with pytest.raises(ValueError, match="counts >= 1"):
        weight_group_times(spec.blocks, spec.example_input(2), [0])


def test_a_grouped_w_leaves_the_running_statistics_as_they_were():
    from twobp.partition.profiler import weight_group_times

    spec = build_model("resnet", "tiny", layers=(1,))
    before = [b.clone() for block in spec.blocks for b in block.buffers()]
    weight_group_times(spec.blocks, spec.example_input(2), [1, 2])
    after = [b for block in spec.blocks for b in block.buffers()]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
