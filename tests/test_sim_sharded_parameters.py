"""Sharded parameters (ZeRO-3) in the simulator, the analytic planner and `twobp plan`:
memory per rank and collective times against figures computed by hand."""

import math
from dataclasses import replace

import pytest

from twobp.cli.main import main
from twobp.sim.analytic import compare_sharding, load_hardware
from twobp.sim.analytic.layout import best_layout
from twobp.sim.analytic.shapes import custom_shape
from twobp.sim.costs import CostModel
from twobp.sim.search import Option, simulate_option

# 4 layers of width 8, 2 heads, MLP 16, 32 tokens: a layer has 2*8*8 + 2*8*8 (attention)
# + 3*8*16 (MLP) + 2*8 (norms) = 656 parameters.
TINY = custom_shape("tiny", layers=4, hidden=8, heads=2, ffn=16, vocab=32)
# P=2, D=2, T=1, micro-batches of 1 sequence of 16 tokens, 4 of them.
DIMS = (2, 2, 1, 1, 4, 16)


def test_with_reduction_divides_parameters_and_optimizer_state_by_the_copies():
    costs = CostModel.uniform(2, parameter_bytes=8.0, optimizer_bytes=16.0, reduce_bandwidth=1.0)
    costs = replace(costs, shard_parameters=True)
    timed = costs.with_reduction(4, costs.parameter_bytes)
    assert timed.parameter_bytes == (2.0, 2.0) and timed.optimizer_bytes == (4.0, 4.0)
    # A ring reduce-scatter (and all-gather) of 8 bytes over 4 ranks: 3 steps of 8/4 bytes.
    assert timed.reduce == (6.0, 6.0) and timed.gather == (6.0, 6.0)
    whole = replace(costs, shard_parameters=False, shard_optimizer=True)
    whole = whole.with_reduction(4, (8.0, 8.0))
    assert whole.parameter_bytes == (8.0, 8.0) and whole.optimizer_bytes == (4.0, 4.0)


def test_peak_counts_a_share_of_the_parameters_and_the_gathered_stage():
    # 1f1b on 2 ranks, 2 micro-batches, fused B; one activation a micro-batch. Weights and
    # gradients 16, optimizer state 16, a stage's whole weights 4, 2 copies.
    base = CostModel.uniform(
        2, activation_bytes=1.0, weight_grad_bytes=0.0, parameter_bytes=16.0, optimizer_bytes=16.0
    )
    option = Option("1f1b", "off", None)
    sharded = replace(base, gathered_bytes=(4.0, 4.0), shard_parameters=True)
    candidate, _ = simulate_option(option, 2, 2, sharded, data_parallel=2)
    # Rank 0 holds both activations at its first B: 16/2 + 16/2 + 4 + 2.
    assert candidate.peak_memory == 22.0
    whole = replace(base, shard_optimizer=True)
    candidate, _ = simulate_option(option, 2, 2, whole, data_parallel=2)
    assert candidate.peak_memory == 16.0 + 16.0 / 2 + 2


def test_an_analytic_layout_with_sharded_parameters_holds_a_share_and_one_stage():
    device = load_hardware("h100")
    # Stage 0: 2 layers and the embedding (32 x 8); stage 1: 2 layers, the final norm
    # and the head (32 x 8 + 8). In bf16, 2 bytes a parameter, AdamW with fp32 masters 12.
    first, last = 2 * 656 + 256, 2 * 656 + 256 + 8
    sharded = best_layout(TINY, device, DIMS, (True, True), "bfloat16")
    assert sharded is not None and sharded.shard_parameters
    memory = sharded.memory
    assert memory["weights"] == 2 * last / 2
    assert memory["gradients"] == 2 * last / 2
    assert memory["optimizer"] == 12 * last / 2
    assert memory["gathered weights"] == 2 * last
    whole = best_layout(TINY, device, DIMS, (True, False), "bfloat16")
    assert whole is not None and not whole.shard_parameters
    assert whole.memory["weights"] == whole.memory["gradients"] == 2 * last
    assert whole.memory["optimizer"] == 12 * last / 2 and "gathered weights" not in whole.memory
    assert first < last
    assert "--shard-parameters" in sharded.options() and "--shard-optimizer" in whole.options()
    assert "shard_parameters=True" in sharded.pipeline_options()


def test_compare_sharding_times_the_collectives_of_a_stage():
    device = load_hardware("h100")
    rows = compare_sharding(TINY, device, DIMS)
    assert [r.layout.shard_parameters for r in rows] == [False, True]
    last = 2 * (2 * 656 + 256 + 8)  # bytes of the larger stage's gradients
    bandwidth, latency = device.inter_bandwidth, 10e-6
    # A reduce-scatter and an all-gather over 2 copies: one step of half the bytes each.
    want = 2 * (latency + last / (2 * bandwidth))
    for row in rows:
        assert math.isclose(row.collectives, want, rel_tol=1e-12), (row.collectives, want)
        assert 0.0 <= row.exposed <= row.collectives + 1e-12
    with pytest.raises(ValueError, match="2 copies or more"):
        compare_sharding(TINY, device, (2, 1, 1, 1, 4, 16))


def test_plan_shard_parameters_searches_both_and_says_which(capsys):
    argv = ["plan", "--layers", "4", "--hidden", "8", "--heads", "2", "--ffn", "16"]
    argv += ["--vocab", "32", "--gpus", "4", "--seq-len", "16", "--global-batch", "8"]
    argv += ["--tensor-parallel", "1"]
    assert main([*argv, "--shard-parameters"]) == 0
    out = capsys.readouterr().out
    assert "parameters sharded" in out or "parameters whole" in out, out
    assert main(["plan", "--shard-parameters"]) == 2
    err = capsys.readouterr().err
    assert "--shard-parameters plans a model's shapes" in err, err


def test_schedule_auto_counts_a_share_of_the_parameters_and_the_gathered_weights():
    from torch import nn

    from twobp.runtime.setup.auto.plan import PARAMETER_FACTOR, OptimizerMemory

    # 4 blocks of 3 x 2 weights and 2 biases (8 float32 parameters, 32 bytes) on 2 stages:
    # a stage's weights are 64 bytes, counted with their gradients as 2 x 64.
    blocks = [nn.Linear(3, 2) for _ in range(4)]
    assert PARAMETER_FACTOR == 2.0

    def costs_for(n_stages: int) -> CostModel:
        return CostModel.uniform(n_stages, parameter_bytes=128.0 * 2 / n_stages)

    def sizes_for(n_stages: int) -> list[int]:
        return [4 // n_stages] * n_stages

    counted = OptimizerMemory(8.0, True, True).counted(costs_for, sizes_for, blocks)(2)
    assert counted.shard_parameters and counted.shard_optimizer
    assert counted.optimizer_bytes == (128.0, 128.0)  # 8 bytes x 16 parameters
    assert counted.gathered_bytes == (64.0, 64.0)  # the weights alone
    assert counted.gather_pieces == 2  # a stage's blocks
    on_two_copies = counted.with_reduction(2, counted.parameter_bytes)
    assert on_two_copies.parameter_bytes == (64.0, 64.0)
    assert on_two_copies.optimizer_bytes == (64.0, 64.0)
    whole = OptimizerMemory(8.0, True).counted(costs_for, sizes_for, blocks)(2)
    assert not whole.shard_parameters and whole.gathered_bytes == (0.0, 0.0)
    assert whole.with_reduction(2, whole.parameter_bytes).parameter_bytes == (128.0, 128.0)
