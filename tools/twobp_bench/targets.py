"""The bench's performance targets, evaluated on its figures (reported, not asserted).

Targets of the two LLaMA regimes, on 2 CPU cores with 1 thread per rank:

* best twobp (``auto`` among them, when it ran) against best
  torch.distributed.pipelining at the largest ``m``: >= 1.25x (large micro-batches),
  >= 1.5x (small); against DeepSpeed's ``PipelineEngine`` (where it ran), the same;
* the step of the fastest twobp variant that runs the group's micro-batches (not
  ``auto-m``, which chooses its own) over the bubble-free step over the same
  micro-batches (the ``microbatched`` reference over ``p``): <= 1.05;
* 1F1B with 2BP against without, at ``m = p``: >= 1.2x;
* efficiency of the best twobp variant at the largest ``m``: >= 0.95 against
  the whole-batch reference (large), >= 0.9 against the 2BP limit (small);
* ``schedule="auto"`` at the largest ``m`` (when ``--schedules`` has ``auto``): within
  3 % of the fastest fixed twobp variant of the run, or faster (their step time over
  auto's >= 0.97);
* simulator: at least 90 % of the twobp variants within 10 % of their measured step.

Each target's detail also says what the run's own figures make of it. The
``auto`` target gives the interquartile range of its round-by-round ratio: a
margin of 3 % inside that range is within this machine's noise. The
simulator target gives how many variants' *replays* (the same schedule
walked with the step's own action times) are within 10 %, and the range of
the steps' compute over the simulator's (from the profiled costs): a replay
within 10 % where the simulation is not puts the error in the profiled
costs, not in the schedule's model.

Each speedup target also gets a *bound*: the most the measured figures allow
it to be. Over torch: the best torch step time over the regime's efficiency
reference divided by ``p`` (a twobp pipeline with no bubble and no overhead
at all): a target above it cannot be met by any runtime on this machine.
The detail adds the same ratio against the faster of the references that keep
the pipelines' micro-batches (``microbatched``, ``2bp-limit``): the whole
batch runs larger, faster products than any pipeline of these micro-batches
does, so this is the nearer estimate of what a perfect pipeline would give.
2BP over no 2BP at ``m = p``: the simulator's ratio of the two schedules
under the profiled costs, what the schedule change alone gives (an estimate,
not a hard limit).

Other regimes get the same figures without thresholds. This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from twobp_bench import matrix

SPEEDUP_OVER_TORCH = {"large": 1.25, "small": 1.5}
TWO_BP_SPEEDUP_AT_P = 1.2
EFFICIENCY = {"large": ("whole-batch", 0.95), "small": ("2bp-limit", 0.9)}
SIMULATOR_ERROR = 0.10
SIMULATOR_SHARE = 0.9
"""Of the twobp variants, the share whose simulated step is within :data:`SIMULATOR_ERROR`."""
AUTO_AGAINST_FIXED = 0.97
STEP_OVER_BUBBLE_FREE = 1.05


def evaluate(regimes: Sequence[Mapping[str, Any]], n_ranks: int) -> list[dict[str, Any]]:
    """Every target of every regime: its value, threshold and whether it is met.

    Args:
        regimes: the regime dictionaries of :func:`twobp_bench.analysis.analyse_regime`.
        n_ranks: pipeline ranks ``p``.

    Returns:
        One dictionary per target: ``regime``, ``target``, ``value``,
        ``threshold``, ``met`` (None without a threshold or a value),
        ``bound`` (None where it has none or it could not be computed) and ``detail``.
    """
    out: list[dict[str, Any]] = []
    for regime in regimes:
        name = regime["name"]
        groups = {g["n_microbatches"]: g for g in regime["groups"]}
        if not groups:
            continue
        largest = groups[max(groups)]
        out.append(_over_torch(name, largest))
        if largest["best"].get("deepspeed"):
            out.append(_over_deepspeed(name, largest))
        if n_ranks in groups:
            out.append(_two_bp_at_p(name, groups[n_ranks], n_ranks))
        out.append(_efficiency(name, largest))
        out.append(_over_bubble_free(name, largest))
        if largest.get("auto"):
            out.append(_auto(name, largest))
        out.append(_simulator(name, list(groups.values())))
    return out


def _target(
    regime: str,
    target: str,
    value: float | None,
    threshold: float | None,
    detail: str,
    above: bool,
    bound: float | None = None,
    spread: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A target's record; ``spread``: the summary (``stats.Summary.as_dict``) of the
    round-by-round ratios whose median ``value`` is, as the report's tables give it."""
    if value is not None and not math.isfinite(value):
        value = None  # a time of 0 (too short to measure): no figure rather than inf
    met = None
    if value is not None and threshold is not None:
        met = value >= threshold if above else value <= threshold
    return {
        "regime": regime,
        "target": target,
        "value": value,
        "threshold": threshold,
        "met": met,
        "above": above,
        "bound": bound if bound is None or math.isfinite(bound) else None,
        "detail": detail,
        "spread": dict(spread) if spread is not None and value is not None else None,
    }


def shown_value(target: Mapping[str, Any]) -> str:
    """A target's figure as the summary and the report give it: the median of the paired
    rounds' ratios with their interquartile range (``0.927 [IQR 0.80-1.05 of 2 rounds]``)
    where it is one, ``not measured`` where there is none (pure)."""
    value = target["value"]
    if value is None:
        return "not measured"
    spread = target.get("spread")
    if not spread:
        return f"{value:.3f}"
    return f"{value:.3f} [IQR {spread['q1']:.2f}-{spread['q3']:.2f} of {spread['n']} rounds]"


def _variant(group: Mapping[str, Any], label: str | None) -> Mapping[str, Any]:
    return next((v for v in group["variants"] if v["label"] == label), {})


def _over_torch(regime: str, group: Mapping[str, Any]) -> dict[str, Any]:
    best = group["best"]
    value = best["speedup"]["median"] if "speedup" in best else None
    detail = f"m={group['n_microbatches']}: {best['twobp']} vs {best['torch']}"
    reference = EFFICIENCY.get(regime, ("whole-batch", None))[0]
    torch_step = _variant(group, best["torch"]).get("step_s", {}).get("median")
    limit = group["reference_bounds_s"].get(reference)
    bound = None
    if torch_step and limit:
        bound = torch_step / limit
        detail += f"; bound: {best['torch']} against {reference} / p"
    if torch_step:
        detail += _same_microbatches(torch_step, group["reference_bounds_s"])
    return _target(
        regime,
        "best twobp / best torch",
        value,
        SPEEDUP_OVER_TORCH.get(regime),
        detail,
        above=True,
        bound=bound,
        spread=best.get("speedup"),
    )


def _over_deepspeed(regime: str, group: Mapping[str, Any]) -> dict[str, Any]:
    """Best twobp over DeepSpeed's PipelineEngine, with the threshold over torch."""
    best = group["best"]
    ratio = best.get("deepspeed_speedup")
    detail = f"m={group['n_microbatches']}: {best['twobp']} vs {best['deepspeed']}"
    step = _variant(group, best["deepspeed"]).get("step_s", {}).get("median")
    if step:
        detail += _same_microbatches(step, group["reference_bounds_s"])
    return _target(
        regime,
        "best twobp / DeepSpeed",
        ratio["median"] if ratio else None,
        SPEEDUP_OVER_TORCH.get(regime),
        detail,
        above=True,
        spread=ratio,
    )


def _same_microbatches(torch_step: float, bounds: Mapping[str, float]) -> str:
    """The over-torch ratio of a pipeline with no bubble and no overhead over the same
    micro-batches: the faster of the references that split the batch as the pipelines do."""
    same = [
        bounds[r]
        for r in (matrix.REFERENCE_MICROBATCHED, matrix.REFERENCE_TWO_BP_LIMIT)
        if bounds.get(r)
    ]
    if not same:
        return ""
    return f"; over the same micro-batches: {torch_step / min(same):.3f}"


def _two_bp_at_p(regime: str, group: Mapping[str, Any], n_ranks: int) -> dict[str, Any]:
    pairs = [
        p
        for p in group["two_bp_speedups"]
        if p["schedule"] == "1f1b" and p["policy"] == "paper" and p.get("recompute") is None
    ]
    value = pairs[0]["speedup"]["median"] if pairs else None
    threshold = TWO_BP_SPEEDUP_AT_P if regime in SPEEDUP_OVER_TORCH else None
    bound = None
    detail = f"m=p={n_ranks}"
    if pairs:
        without = _variant(group, pairs[0]["without"]).get("sim_step_s")
        with_2bp = _variant(group, pairs[0]["with"]).get("sim_step_s")
        if without and with_2bp:
            bound = without / with_2bp
            detail += "; bound: the simulator's ratio"
    spread = pairs[0]["speedup"] if pairs else None
    return _target(
        regime, "1f1b: 2BP / no 2BP", value, threshold, detail, True, bound=bound, spread=spread
    )


def _over_bubble_free(regime: str, group: Mapping[str, Any]) -> dict[str, Any]:
    """The fastest twobp step over the group's micro-batches against the bubble-free step
    over the same micro-batches (the microbatched reference over p)."""
    bound = group["reference_bounds_s"].get(matrix.REFERENCE_MICROBATCHED)
    ranked = [
        (v["step_s"]["median"], v["label"])
        for v in group["variants"]
        if v["framework"] == matrix.TWOBP
        and v.get("schedule") != matrix.AUTO_MICROBATCHES
        and (v.get("step_s") or {}).get("median")
    ]
    value, label = None, "none"
    if ranked and bound:
        step, label = min(ranked)
        value = step / bound
    detail = f"m={group['n_microbatches']}: {label} against reference microbatched / p"
    threshold = STEP_OVER_BUBBLE_FREE if regime in SPEEDUP_OVER_TORCH else None
    return _target(regime, "step / bubble-free step", value, threshold, detail, above=False)


def _efficiency(regime: str, group: Mapping[str, Any]) -> dict[str, Any]:
    reference, threshold = EFFICIENCY.get(regime, ("whole-batch", None))
    ranked = [
        (v["efficiency"].get(reference), v["label"])
        for v in group["variants"]
        if v["framework"] == matrix.TWOBP and "efficiency" in v
    ]
    ranked = [(e, label) for e, label in ranked if e is not None]
    value, label = max(ranked) if ranked else (None, "none")
    detail = f"m={group['n_microbatches']}: {label} against reference {reference}"
    return _target(regime, f"efficiency vs {reference}", value, threshold, detail, above=True)


def _auto(regime: str, group: Mapping[str, Any]) -> dict[str, Any]:
    auto = group["auto"]
    ratio = auto["speedup"]
    detail = (
        f"m={group['n_microbatches']}: {auto['best_fixed']} over {auto['auto']} "
        f"({auto['chose'] or 'its choice unknown'}); rounds' IQR "
        f"{ratio['q1']:.3f}-{ratio['q3']:.3f}"
    )
    return _target(
        regime,
        "best fixed twobp / auto",
        auto["speedup"]["median"],
        AUTO_AGAINST_FIXED if regime in SPEEDUP_OVER_TORCH else None,
        detail,
        above=True,
        spread=ratio,
    )


def _simulator(regime: str, groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    simulated = [
        (g["n_microbatches"], v)
        for g in groups
        for v in g["variants"]
        if v.get("sim_error") is not None
    ]
    errors = [(abs(v["sim_error"]), f"m={m} {v['label']}") for m, v in simulated]
    value = None
    detail = "no simulated variant"
    if errors:
        within = sum(e <= SIMULATOR_ERROR for e, _ in errors)
        value = within / len(errors)
        worst, label = max(errors)
        detail = (
            f"{within} of {len(errors)} within {SIMULATOR_ERROR:.0%}; worst {worst:.1%} ({label})"
        )
        detail += _replay_detail([v for _, v in simulated])
    threshold = SIMULATOR_SHARE if regime in SPEEDUP_OVER_TORCH else None
    return _target(
        regime,
        f"share within {SIMULATOR_ERROR:.0%} of the simulator",
        value,
        threshold,
        detail,
        above=True,
    )


def _replay_detail(variants: Sequence[Mapping[str, Any]]) -> str:
    """What the simulated variants' replays and busy times say of their errors."""
    replays = [abs(v["replay_error"]) for v in variants if v.get("replay_error") is not None]
    busy = sorted(
        v["busy_s"] / v["sim_busy_s"] for v in variants if v.get("busy_s") and v.get("sim_busy_s")
    )
    out = ""
    if replays:
        near = sum(e <= SIMULATOR_ERROR for e in replays)
        out += f"; replay with the steps' own action times: {near} of {len(replays)} within"
    if busy:
        out += f"; compute in steps {busy[0]:.2f}-{busy[-1]:.2f}x the profiled"
    return out
