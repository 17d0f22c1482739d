"""What the 2BP engine deferred on a rank, for the run's report.

Each stage that splits its backward has a :class:`twobp.engine.WeightGradStore`,
whose routes say, parameter by parameter, whether W adds its gradient and
which operations read it. The report gives the share of weight elements W
adds in full, and the stacked expert weights W concatenates per expert
(``F.linear per expert x8``: eight experts' products, each over every
micro-batch its W covers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from twobp.engine.coverage import ParameterRoute, Route


@dataclass(frozen=True)
class EngineSummary:
    """One rank's split stages, as their stores saw the forwards.

    Args:
        weights: trainable weight elements of the split stages.
        deferred: of those, the elements whose gradient W adds in full.
        expert_parameters: stacked expert parameters W concatenates per expert.
        expert_products: the per-expert products of those (experts x parameters).
    """

    weights: int = 0
    deferred: int = 0
    expert_parameters: int = 0
    expert_products: int = 0


def summarize(routes: Iterable[ParameterRoute]) -> EngineSummary:
    """The summary of these routes (pure)."""
    weights = deferred = parameters = products = 0
    for r in routes:
        if r.route is Route.FROZEN:
            continue
        weights += r.parameter.numel()
        if r.route is Route.DEFERRED and not r.partly_immediate:
            deferred += r.parameter.numel()
        if r.expert_products and r.route is Route.DEFERRED:
            parameters += 1
            products += r.expert_products
    return EngineSummary(weights, deferred, parameters, products)


def rank_summary(stages: Iterable[Any]) -> EngineSummary:
    """The summary of a rank's stages (those without a store, fused, count nothing)."""
    routes: list[ParameterRoute] = []
    for stage in stages:
        read = getattr(stage.gradients, "routes", None)
        if read is not None:
            routes.extend(read())
    return summarize(routes)


def report_line(summaries: Sequence[EngineSummary]) -> str | None:
    """One line of the report over every rank's summary; None where no stage split."""
    weights = sum(s.weights for s in summaries)
    if not weights:
        return None
    share = sum(s.deferred for s in summaries) / weights
    line = f"2BP engine: {share:.1%} of the split stages' weight elements deferred to W"
    parameters = sum(s.expert_parameters for s in summaries)
    if parameters:
        products = sum(s.expert_products for s in summaries)
        line += (
            f"; {parameters} stacked expert weights concatenated per expert over the "
            f"micro-batches ({products} expert products)"
        )
    return line
