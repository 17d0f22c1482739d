"""One layout with its parameters sharded over the copies and without, on analytic costs.

For a given ``P x D x T`` and micro-batch size, :func:`compare_sharding` takes the
best candidate of the layout (:func:`twobp.sim.analytic.layout.best_layout`) with
the optimizer state sharded over the ``D`` copies (``pipe.shard_optimizer``) and
with the parameters, gradients and optimizer state sharded
(``Pipeline(shard_parameters=True)``), and what the gradient reduce-scatters and
weight all-gathers cost it: their time on the link, and how much later the step
ends because of them (against the same candidate simulated on one copy). Both layouts
run the same collectives each step (twobp's ZeRO-1 gathers the updated weights
too); what sharding the parameters changes is the memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from twobp.schedule.gradient_scatter import scatter_points, scattered_each_w
from twobp.sim.analytic.hardware import Hardware
from twobp.sim.analytic.layout import STEP_SHARDED, Layout, best_layout, layout_costs
from twobp.sim.analytic.shapes import DecoderShape
from twobp.sim.costs import CostModel, reduce_scatter_time
from twobp.sim.search import Option, simulate_option


@dataclass(frozen=True)
class ShardingRow:
    """One layout's best candidate and what its collectives cost.

    Args:
        layout: the layout and its candidate.
        collectives: seconds a rank's link spends each step on its stages' gradient
            reduce-scatter and weight all-gather.
        exposed: how much later the step ends than the same candidate's on one copy,
            without them (overlap hides the rest).
    """

    layout: Layout
    collectives: float
    exposed: float
    scatter_each_w: bool = False
    """With sharded parameters: the gradients reduce-scattered after each ``W`` (or ``B``)
    of a stage rather than once at its ``R`` (``CostModel.scatter_each_w``)."""

    @property
    def peak(self) -> float:
        """Bytes per rank at the peak: the sum of the layout's memory breakdown."""
        return sum(self.layout.memory.values())


def compare_sharding(
    shape: DecoderShape,
    device: Hardware,
    dims: tuple[int, int, int, int, int, int],
    dtype: str = "bfloat16",
    tried: tuple[Sequence[str], Sequence[str], Sequence[str]] | None = None,
) -> list[ShardingRow]:
    """The layout ``dims`` with whole parameters (the optimizer state sharded), with
    sharded parameters, and the same candidate with its gradients reduce-scattered after
    each ``W`` (or ``B``) rather than at ``R``, in that order; a setting that fits no
    device is left out.

    Args:
        shape: the decoder.
        device: the hardware.
        dims: ``(P, D, T, micro-batch size, micro-batches, sequence length)``, ``D > 1``.
        dtype: of the weights and compute.
        tried: the schedules, 2BP policies and recompute modes searched (None: those
            of ``twobp plan``).

    Raises:
        ValueError: if ``D < 2`` (nothing to shard over).
    """
    pipeline, data = dims[0], dims[1]
    if data < 2:
        raise ValueError(f"D={data}: sharding needs 2 copies or more")
    rows = []
    for sharded in (False, True):
        given = {} if tried is None else {"tried": tried}
        layout = best_layout(shape, device, dims, (True, sharded), dtype, **given)
        if layout is None:
            continue
        costs, _, _ = layout_costs(shape, device, dims, (True, sharded), dtype)
        option = Option.of(layout.candidate)
        # The same step on one copy: no reduction, no gather.
        without, _ = simulate_option(option, pipeline, layout.microbatches, costs.for_stages)
        assert costs.parameter_bytes is not None and costs.reduce_bandwidth is not None
        gradients = max(costs.parameter_bytes)  # a rank's stages: one stage's worth
        one_way = reduce_scatter_time(gradients, data, costs.reduce_bandwidth, costs.send_latency)
        rows.append(ShardingRow(layout, 2 * one_way, layout.step - without.makespan))
        if sharded:
            rows.append(_each_w(layout, costs, one_way, without.makespan))
    return rows


def _each_w(layout: Layout, costs: CostModel, one_way: float, alone: float) -> ShardingRow:
    """The sharded layout's candidate with its gradients reduce-scattered after each ``W``
    (or ``B``): its peak, and on the link a reduce-scatter of its stage's gradients for
    each ``W`` and the all-gather of the rank's weights (the most of any rank)."""
    option = Option.of(layout.candidate)
    each = replace(costs, scatter_each_w=True)
    pipeline, m, data = layout.pipeline, layout.microbatches, layout.data
    candidate, schedule = simulate_option(option, pipeline, m, each.for_stages, data_parallel=data)
    assert schedule is not None and costs.reduce_bandwidth is not None
    fitted = costs.for_stages(schedule.n_stages)
    assert fitted.parameter_bytes is not None
    scatters = max(
        sum(
            reduce_scatter_time(
                fitted.parameter_bytes[stage], data, costs.reduce_bandwidth, costs.send_latency
            )
            for stage in scatter_points(acts, scattered_each_w(acts, True)).values()
        )
        for acts in schedule.actions.values()
    )
    memory = dict(layout.memory)
    static = sum(v for k, v in memory.items() if k not in (STEP_SHARDED, "weights"))
    memory[STEP_SHARDED] = max(candidate.peak_memory - static, 0.0)
    moved = replace(layout, candidate=candidate, step=candidate.makespan, memory=memory)
    return ShardingRow(moved, scatters + one_way, candidate.makespan - alone, True)
