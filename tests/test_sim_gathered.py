"""Sharded parameters in the simulator's memory: a stage's weights gathered from its
first F to its last I (or W), against peaks counted by hand."""

import pytest

from twobp.schedule import apply_two_bp, generate
from twobp.schedule.action import Action
from twobp.sim.costs import CostModel
from twobp.sim.memory import peak_memory
from twobp.sim.simulate import simulate
from twobp.timeline import Span

# One rank, one stage, two micro-batches: F0 F1 I0 I1, then one W of both.
SPANS = [
    Span(0, Action.parse("0F0"), 0.0, 1.0),
    Span(0, Action.parse("0F1"), 1.0, 2.0),
    Span(0, Action.parse("0I0"), 2.0, 3.0),
    Span(0, Action.parse("0I1"), 3.0, 4.0),
    Span(0, Action.parse("0W0-1"), 4.0, 6.0),
]


def _costs(**kw) -> CostModel:
    given = {"gathered_bytes": (10.0,), **kw}
    return CostModel(
        forward=(1.0,),
        backward_input=(1.0,),
        backward_weight=(1.0,),
        activation_bytes=(1.0,),
        weight_grad_bytes=(2.0,),
        **given,
    )


def test_weights_freed_before_w_and_after_w_by_hand():
    # Activations 1 per micro-batch from F to I, a stash of 2 from I to W, weights 10.
    # Freed before W: the most is at the end of I0 (t=3): 10 + 1 activation + 2 stash = 13;
    # at the end of I1 the weights go before the second stash comes (4 at most after).
    assert peak_memory(SPANS, _costs(), [0]) == (13.0,)
    # Freed after W: at the end of I1 the weights and both stashes: 10 + 4 = 14.
    assert peak_memory(SPANS, _costs(free_before_w=False), [0]) == (14.0,)
    # Nothing gathered: 1 + 2 at t=3, then 4.
    assert peak_memory(SPANS, _costs(gathered_bytes=(0.0,)), [0]) == (4.0,)


@pytest.mark.parametrize(("name", "v"), [("1f1b", None), ("interleaved-1f1b", 2), ("zb-v", None)])
def test_freeing_before_w_never_holds_more(name, v):
    schedule = apply_two_bp(generate(name, 2, 8, stages_per_rank=v), "paper")
    base = CostModel.uniform(2).for_schedule(schedule.n_stages, schedule.n_pipelines)
    gathered = (3.0,) * schedule.n_stages
    before = CostModel(**{**base.__dict__, "gathered_bytes": gathered})
    after = CostModel(**{**before.__dict__, "free_before_w": False})
    result = simulate(schedule, before)
    spans = list(result.spans)
    low = peak_memory(spans, before, schedule.placement)
    high = peak_memory(spans, after, schedule.placement)
    assert all(a <= b for a, b in zip(low, high, strict=True))
    plain = peak_memory(spans, base, schedule.placement)
    assert all(a > b for a, b in zip(low, plain, strict=True))  # the weights count
