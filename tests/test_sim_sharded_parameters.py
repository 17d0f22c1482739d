"""Sharded parameters (ZeRO-3) in the simulator, the analytic planner and `twobp plan`:
memory per rank and collective times against figures computed by hand."""

import math
from dataclasses import replace

import pytest

from twobp.cli.main import main
from twobp.schedule.action import Action
from twobp.sim.analytic import compare_sharding, load_hardware
from twobp.sim.analytic.layout import STEP_SHARDED, best_layout
from twobp.sim.analytic.shapes import custom_shape
from twobp.sim.costs import CostModel
from twobp.sim.memory import peak_memory
from twobp.sim.search import Option, simulate_option
from twobp.timeline import Span

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
    # Rank 0 at the start of its first B: shards 16/2 + 16/2, the stage's weights 4, both
    # activations 2, and the whole gradients (4, as the weights) its Bs make until its R.
    assert candidate.peak_memory == 26.0
    whole = replace(base, shard_optimizer=True)
    candidate, _ = simulate_option(option, 2, 2, whole, data_parallel=2)
    assert candidate.peak_memory == 16.0 + 16.0 / 2 + 2


def test_the_whole_gradients_take_the_room_freeing_the_weights_before_w_leaves():
    # One rank, one stage, two micro-batches: F0 F1 I0 I1, then one W of both. Activations
    # 1 a micro-batch from F to I, a stash of 2 from I to W, weights 10, and under sharded
    # parameters the stage's whole gradients (as many bytes as its weights) from W's start
    # until its end, when R reduce-scatters them.
    spans = [
        Span(0, Action.parse("0F0"), 0.0, 1.0),
        Span(0, Action.parse("0F1"), 1.0, 2.0),
        Span(0, Action.parse("0I0"), 2.0, 3.0),
        Span(0, Action.parse("0I1"), 3.0, 4.0),
        Span(0, Action.parse("0W0-1"), 4.0, 6.0),
    ]
    costs = CostModel(
        forward=(1.0,),
        backward_input=(1.0,),
        backward_weight=(1.0,),
        activation_bytes=(1.0,),
        weight_grad_bytes=(2.0,),
        gathered_bytes=(10.0,),
        shard_parameters=True,
    )
    # Freed before W: 10 + 1 + 2 at the end of I0; in W both stashes and the gradients.
    assert peak_memory(spans, costs, [0]) == (14.0,)
    # Kept through W: the weights, both stashes and the gradients at once.
    assert peak_memory(spans, replace(costs, free_before_w=False), [0]) == (24.0,)
    # Whole parameters (gradients in parameter_bytes): the weights until the end of I.
    assert peak_memory(spans, replace(costs, shard_parameters=False), [0]) == (13.0,)


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
    # The step's part holds the stage's gathered weights at least, on top of the shards.
    assert memory[STEP_SHARDED] >= 2 * last
    assert sum(memory.values()) == memory["weights"] + sharded.candidate.peak_memory
    whole = best_layout(TINY, device, DIMS, (True, False), "bfloat16")
    assert whole is not None and not whole.shard_parameters
    assert whole.memory["weights"] == whole.memory["gradients"] == 2 * last
    assert whole.memory["optimizer"] == 12 * last / 2 and STEP_SHARDED not in whole.memory
    assert first < last
    assert "--shard-parameters" in sharded.options() and "--shard-optimizer" in whole.options()
    assert "shard_parameters=True" in sharded.pipeline_options()


def test_compare_sharding_times_the_collectives_of_a_stage():
    device = load_hardware("h100")
    rows = compare_sharding(TINY, device, DIMS)
    assert [r.layout.shard_parameters for r in rows] == [False, True, True]
    assert [r.scatter_each_w for r in rows] == [False, False, True]
    last = 2 * (2 * 656 + 256 + 8)  # bytes of the larger stage's gradients
    bandwidth, latency = device.inter_bandwidth, 10e-6
    # A reduce-scatter and an all-gather over 2 copies: one step of half the bytes each.
    want = 2 * (latency + last / (2 * bandwidth))
    for row in rows[:2]:
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


def test_schedule_auto_plans_with_the_parameters_sharded_as_the_pipeline_will_run():
    import torch

    from twobp.runtime.options import PipelineOptions
    from twobp.runtime.setup.auto.plan import OptimizerMemory
    from twobp.runtime.setup.pipeline_plan import _Planning

    def planned(**options: object) -> OptimizerMemory:
        planning = _Planning(
            blocks=[],
            world=None,  # type: ignore[arg-type]
            device=torch.device("cpu"),
            options=PipelineOptions(**options),  # type: ignore[arg-type]
            example_input=None,
            pipeline_ranks=None,
            data_parallel=2,
            tied=False,
            sample=None,
        )
        return planning.optimizer

    assert planned(shard_parameters=True, optimizer_state_bytes=12.0) == OptimizerMemory(
        12.0, True, True
    )
    assert planned(optimizer_sharded=True) == OptimizerMemory(0.0, True, False)
    assert planned() == OptimizerMemory(0.0, False, False)


def test_whole_gradients_reduce_scattered_after_each_w_are_held_only_in_it():
    # One rank, one stage: F0 F1 I0 W0 F2 I1 W1 I2 W2 R, every action 1 long. Activations
    # 4 a micro-batch, stashes 1, the stage's weights and gradients 2 each.
    order = ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2", "0R0-2"]
    spans, t = [], 0.0
    for text in order:
        d = 0.0 if text.startswith("0R") else 1.0
        spans.append(Span(0, Action.parse(text), t, t + d))
        t += d
    costs = CostModel(
        forward=(1.0,),
        backward_input=(1.0,),
        backward_weight=(1.0,),
        activation_bytes=(4.0,),
        weight_grad_bytes=(1.0,),
        gathered_bytes=(2.0,),
        shard_parameters=True,
        reduce=(0.0,),
    )
    # At R: from W0 on, F2 holds 2 activations, a stash, the weights and the gradients.
    assert peak_memory(spans, costs, [0]) == (12.0,)
    # After each W (asked for, or by the rule: F2 and I1 lie between W0 and W2): 10.
    assert peak_memory(spans, replace(costs, scatter_each_w=True), [0]) == (10.0,)
    assert peak_memory(spans, replace(costs, scatter_each_w=None), [0]) == (10.0,)
    # A reduce-scatter slower than F2 holds W0's gradients through it: as at R.
    slow = replace(costs, scatter_each_w=True, reduce=(1.5,))
    assert peak_memory(spans, slow, [0]) == (12.0,)
    # Holders that would not pair up (two pipelines listing different W): at R, as the
    # runtime agrees (twobp.schedule.gradient_scatter.scattered_each_w_by_rank).
    each = replace(costs, scatter_each_w=True)
    assert peak_memory(spans, each, [0], {0: frozenset()}) == (12.0,)
    assert peak_memory(spans, each, [0], {0: frozenset({0})}) == (10.0,)


def test_the_simulator_scatters_each_w_where_the_runtime_does_under_two_pipelines():
    from twobp.schedule.schedule import Schedule
    from twobp.sim.result import scattering

    acts = (
        "0F0 0F1 3F2 3I2 0I0 0I1 3F3 3I3 3W2-3 3R2-3 0W0-1 0R0-1",
        "2F2 1F0 1I0 1F1 1I1 2F3 2I2 1W0 2I3 2W2-3 2R2-3 1W1 1R0-1",
    )
    chimera = Schedule(
        placement=(0, 1, 1, 0),
        n_microbatches=4,
        actions={r: tuple(Action.parse(a) for a in text.split()) for r, text in enumerate(acts)},
        n_pipelines=2,
    )
    costs = replace(CostModel.uniform(4), shard_parameters=True)
    assert scattering(chimera, costs) is None
    assert scattering(chimera, replace(costs, scatter_each_w=True)) == {0: {0}, 1: {2}}
