"""From what the ranks measured to the bench's figures: one JSON-ready dictionary.

Step times of a pipeline variant are rank 0's (both barriers make every rank
see the same step); a reference's time in a round is the mean over the ranks,
each of which ran it alone. Speedups are medians of round-by-round ratios
(two variants of one round ran next to each other). Efficiency is the
reference's time divided by ``p``, over the variant's median step time. The
gradient check compares every parameter's gradient sketch with that of the
whole-batch reference (:func:`gradient_error`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from twobp.schedule import is_split
from twobp.sim.reduction import with_reductions
from twobp_bench import matrix
from twobp_bench.job import RankReport, VariantRecord
from twobp_bench.profile import RankProfile
from twobp_bench.simcheck import replayed_step, simulated_step, stage_costs
from twobp_bench.stats import Summary, speedup, summarize


def analyse_regime(
    reports: Sequence[RankReport], n_ranks: int, data_parallel: int = 1
) -> dict[str, Any]:
    """The figures of one regime from every rank's report.

    Args:
        reports: one report per rank of the first copy, indexed by rank.
        n_ranks: pipeline ranks ``p``.
        data_parallel: copies of every twobp pipeline (their replicas of a
            stage all-reduce its gradients with the first copy's).

    Returns:
        The regime's dictionary (see the keys set below; sizes in bytes, times in seconds).
    """
    lead = reports[0]
    regime = lead.regime
    # Rows of a linear layer's GEMM: samples x tokens (None for models without tokens).
    tokens = lead.model_config.get("seq_len")
    groups = []
    for m in sorted({rec.n_microbatches for rec in lead.records}):
        per_rank = [[rec for rec in r.records if rec.n_microbatches == m] for r in reports]
        profiles = [r.profiles.get(m) for r in reports]
        group = _group(per_rank, m, regime.microbatch_size, n_ranks, profiles, data_parallel)
        group["profile"] = _profile_dict(profiles[0]) if profiles[0] is not None else None
        groups.append(group)
    return {
        "name": regime.name,
        "description": regime.description,
        "microbatch_size": regime.microbatch_size,
        "rows_per_gemm": None if tokens is None else regime.microbatch_size * int(tokens),
        "model": lead.model_config,
        "block_kinds": lead.block_kinds,
        "device": lead.device,
        "threads": lead.threads,
        "peak_rss_bytes": [r.peak_rss_bytes for r in reports],
        "groups": groups,
    }


def _profile_dict(profile: RankProfile) -> dict[str, Any]:
    """Rank 0's profile (medians over the timed rounds)."""
    return {
        "rounds": profile.rounds,
        "link_latency_s": profile.link_latency,
        # None where too fast to measure (inf): results.json stays JSON.
        "link_bandwidth_bytes_per_s": _finite(profile.link_bandwidth),
        "contention": profile.contention,
        "reduce_bandwidth_bytes_per_s": _finite(profile.reduce_bandwidth),
        "blocks_rank0": [
            {
                "name": c.name,
                "forward_s": c.forward,
                "backward_input_s": c.backward_input,
                "backward_weight_s": c.backward_weight,
                "backward_full_s": c.backward_full,
                "weight_concat_s": {str(k): v for k, v in table.items()},
            }
            for c, table in zip(profile.blocks, profile.weight_concat, strict=True)
        ],
    }


def _group(
    per_rank: Sequence[Sequence[VariantRecord]],
    m: int,
    microbatch_size: int,
    n_ranks: int,
    profiles: Sequence[Any],
    data_parallel: int = 1,
) -> dict[str, Any]:
    batch = m * microbatch_size
    references = _references(per_rank)
    reference_bounds = {
        name: statistics.median(times) / n_ranks for name, times in references.items()
    }
    baseline_grads = _baseline_grads(per_rank)
    send_overhead = _send_overhead(per_rank)
    step_overhead = _step_overhead(per_rank)
    variants = []
    times: dict[str, list[float]] = {}
    records_of = _records_by_label(per_rank)
    for lead in per_rank[0]:
        records = records_of[lead.variant.label]
        entry = _variant(
            records,
            batch,
            n_ranks,
            reference_bounds,
            baseline_grads,
            profiles,
            send_overhead,
            data_parallel,
            step_overhead,
        )
        if "memory" in entry:
            entry["memory_peaks"] = _memory_peaks(records, records_of)
        if references.get(lead.variant.schedule) and not lead.variant.is_pipeline:
            times[lead.variant.label] = references[lead.variant.schedule]
        elif lead.skipped is None and lead.step_seconds:
            times[lead.variant.label] = lead.step_seconds
        variants.append(entry)
    return {
        "n_microbatches": m,
        "batch_size": batch,
        "variants": variants,
        "reference_bounds_s": reference_bounds,
        "send_overhead_s": send_overhead,
        "step_overhead_s": step_overhead,
        "two_bp_speedups": _two_bp_speedups(records_of, times),
        "against_baseline": _against_baseline(times),
        "same_schedule": _same_schedule(times),
        "best": _best(variants, times),
        "auto": _auto_against_fixed(variants, times),
    }


def _send_overhead(per_rank: Sequence[Sequence[VariantRecord]]) -> float:
    """The time a rank spends on one send to another rank: the median over this
    twobp's variants, ranks and rounds (0 if none sent anything)."""
    times = [
        t
        for records in per_rank
        for r in records
        if r.variant.framework == matrix.TWOBP
        for t in r.send_seconds
    ]
    return statistics.median(times) if times else 0.0


def _step_overhead(per_rank: Sequence[Sequence[VariantRecord]]) -> float:
    """A step's time outside its schedule: the median over this twobp's variants and
    rounds, as the first rank measured it (0 if none ran)."""
    times = [
        t for r in per_rank[0] if r.variant.framework == matrix.TWOBP for t in r.outside_seconds
    ]
    return statistics.median(times) if times else 0.0


def _references(per_rank: Sequence[Sequence[VariantRecord]]) -> dict[str, list[float]]:
    """Per reference, its time in each round: the mean over the ranks that ran it alone."""
    out: dict[str, list[float]] = {}
    for index, lead in enumerate(per_rank[0]):
        if lead.variant.is_pipeline or lead.skipped is not None or not lead.step_seconds:
            continue
        rounds = zip(*(records[index].step_seconds for records in per_rank), strict=True)
        out[lead.variant.schedule] = [statistics.fmean(r) for r in rounds]
    return out


Sketch = dict[str, tuple[float, ...]]
"""``parameter name -> (gradient norm, projections ...)``, see ``runner.gradient_sketch``."""


def _variant_grads(records: Sequence[VariantRecord]) -> Sketch | None:
    """The whole model's gradient sketch of one variant (None if it has none).

    A pipeline's ranks hold one part of the model each; a reference ran the
    whole model on every rank, and rank 0's run stands for it.
    """
    if records[0].grad_sketch is None:
        return None
    if not records[0].variant.is_pipeline:
        return dict(records[0].grad_sketch)
    merged: Sketch = {}
    for record in records:
        merged.update(record.grad_sketch or {})
    return merged


def _baseline_grads(per_rank: Sequence[Sequence[VariantRecord]]) -> Sketch | None:
    """The gradient sketch of the whole-batch reference, else of the first variant that ran."""
    sketches = [
        (lead.variant.schedule, _variant_grads([rank[i] for rank in per_rank]))
        for i, lead in enumerate(per_rank[0])
    ]
    ran = [(schedule, s) for schedule, s in sketches if s is not None]
    for schedule, sketch in ran:
        if schedule == matrix.REFERENCE_WHOLE_BATCH:
            return sketch
    return ran[0][1] if ran else None


def gradient_error(got: Sketch, want: Sketch) -> float:
    """The largest difference of any parameter's gradient from ``want``'s, relative.

    For each parameter, the largest difference of its norm and projections,
    over the norm of its gradient in ``want`` (absolute where that is 0).

    Returns:
        The largest over all parameters; infinite if the two sketches do not
        name the same parameters.
    """
    if set(got) != set(want):
        return math.inf
    worst = 0.0
    for name, reference in want.items():
        difference = max(abs(a - b) for a, b in zip(got[name], reference, strict=True))
        worst = max(worst, difference / reference[0] if reference[0] > 0 else difference)
    return worst


def _variant(
    records: Sequence[VariantRecord],
    batch: int,
    n_ranks: int,
    bounds: Mapping[str, float],
    baseline_grads: Sketch | None,
    profiles: Sequence[Any],
    send_overhead: float = 0.0,
    data_parallel: int = 1,
    step_overhead: float = 0.0,
) -> dict[str, Any]:
    lead = records[0]
    v = lead.variant
    entry: dict[str, Any] = {
        "label": v.label,
        "framework": v.framework,
        "schedule": v.schedule,
        # auto's is what it chose.
        "two_bp": is_split(lead.schedule) if matrix.is_auto(v) and lead.schedule else v.two_bp,
        "policy": v.policy,
        "partition": list(lead.partition),
        "stage_ranks": list(lead.stage_ranks),
        "chose": lead.chose,
        "skipped": lead.skipped,
        "cut_into": lead.cut_into,
    }
    if lead.skipped is not None or not lead.step_seconds:
        return entry
    if v.is_pipeline:
        samples = lead.step_seconds
    else:
        samples = [
            statistics.fmean(r) for r in zip(*(x.step_seconds for x in records), strict=True)
        ]
    step = summarize(samples)
    entry["step_seconds"] = samples
    entry["step_s"] = step.as_dict()
    entry["samples_per_s"] = step.inverse(batch).as_dict()
    entry["bubble_ratio"] = statistics.median(lead.bubble_ratios) if lead.bubble_ratios else None
    entry["busy_s"] = statistics.median(lead.busy_seconds) if lead.busy_seconds else None
    entry["cpu_s"] = [statistics.median(r.cpu_seconds) if r.cpu_seconds else None for r in records]
    if any(r.update_seconds for r in records):
        # The optimizer update a DeepSpeed step includes, per rank (the others have none).
        entry["update_s"] = [
            statistics.median(r.update_seconds) if r.update_seconds else None for r in records
        ]
    if lead.rank_bubble_ratios:
        per_rank = zip(*lead.rank_bubble_ratios, strict=True)
        entry["rank_bubble"] = [statistics.median(b) for b in per_rank]
    if lead.action_seconds:
        entry["rank_compute_s"] = _rank_compute(lead, n_ranks)
    entry["peak_step_bytes"] = [r.peak_step_bytes for r in records]
    entry["stashed_bytes"] = [r.stashed_bytes for r in records] if entry["two_bp"] else None
    entry["parameter_bytes"] = [r.parameter_bytes for r in records]
    entry["recompute"] = v.recompute
    if any(r.memory for r in records):
        entry["memory"] = [r.memory for r in records]
    grads = _variant_grads(records)
    entry["grad_norm"] = (
        math.sqrt(sum(s[0] ** 2 for s in grads.values())) if grads is not None else None
    )
    entry["grad_rel_error"] = (
        gradient_error(grads, baseline_grads)
        if grads is not None and baseline_grads is not None
        else None
    )
    if v.is_pipeline:
        entry["efficiency"] = {name: bound / step.median for name, bound in bounds.items()}
    if v.framework == matrix.TWOBP and lead.schedule is not None and all(profiles):
        simulated = simulated_step(
            lead.schedule, profiles, lead.partition, send_overhead, data_parallel
        )
        entry["sim_step_s"] = simulated.makespan + step_overhead
        entry["sim_busy_s"] = sum(simulated.busy) / len(simulated.busy)
        entry["sim_error"] = entry["sim_step_s"] / step.median - 1.0
    if v.framework == matrix.TWOBP and lead.run_actions and lead.action_seconds:
        link = (0.0, float("inf"))
        send_bytes = reduce = None
        if all(profiles):
            link = (profiles[0].link_latency, profiles[0].link_bandwidth)
            model = stage_costs(profiles, lead.partition, lead.stage_ranks)
            if lead.schedule is not None:
                model = with_reductions(lead.schedule, model, data_parallel)[1]
            send_bytes, reduce = model.send_bytes, model.reduce
        replayed = replayed_step(
            lead.run_actions,
            lead.stage_ranks,
            lead.n_microbatches,
            lead.action_seconds,
            link,
            send_bytes,
            lead.schedule.n_pipelines if lead.schedule is not None else 1,
            send_overhead,
            reduce,
        )
        entry["action_s"] = {
            key: statistics.median(times) for key, times in sorted(lead.action_seconds.items())
        }
        entry["replay_step_s"] = replayed.makespan + step_overhead
        entry["replay_error"] = entry["replay_step_s"] / step.median - 1.0
    return entry


def _rank_compute(record: VariantRecord, n_ranks: int) -> list[dict[str, float]]:
    """Per rank, the compute seconds of each action kind in a step (mean over the rounds)."""
    out: list[dict[str, float]] = [{} for _ in range(n_ranks)]
    rounds = max(1, len(record.step_seconds))
    for key, durations in sorted(record.action_seconds.items()):
        stage, kind, _ = key.split(":")
        kinds = out[record.stage_ranks[int(stage)]]
        kinds[kind] = kinds.get(kind, 0.0) + sum(durations) / rounds
    return out


def _records_by_label(
    per_rank: Sequence[Sequence[VariantRecord]],
) -> dict[str, list[VariantRecord]]:
    """Every variant's records, one per rank, by the variant's label (in run order)."""
    return {r.variant.label: [rank[i] for rank in per_rank] for i, r in enumerate(per_rank[0])}


def _memory_peaks(
    records: Sequence[VariantRecord], records_of: Mapping[str, Sequence[VariantRecord]]
) -> dict[str, Any]:
    """The largest rank's memory figures of a twobp variant, and its step peak over
    that of the same schedule run without 2BP and without recomputation (None where
    no such variant ran: a natively split schedule has none)."""
    v = records[0].variant
    plain = (
        None if matrix.is_auto(v) else records_of.get(matrix.Variant(v.framework, v.schedule).label)
    )
    peak = _max_bytes(records)
    plain_peak = None if plain is None or plain[0].variant.two_bp else _max_bytes(plain)
    stats = [r.memory for r in records if r.memory]
    return {
        "step_bytes": peak,
        "step_vs_no_2bp": peak / plain_peak if peak and plain_peak else None,
        "activations_bytes": _largest(m.get("activations") for m in stats),
        "stash_bytes": _largest(m.get("stash") for m in stats),
    }


def _two_bp_speedups(
    records: Mapping[str, Sequence[VariantRecord]], times: Mapping[str, list[float]]
) -> list[dict[str, Any]]:
    """For every fused twobp schedule run both ways: 2BP's speedup and memory ratio."""
    out = []
    for label, recs in records.items():
        v = recs[0].variant
        if v.framework not in matrix.PIPELINES_OF_TWOBP or v.policy is None:
            continue
        off_label = v.fused.label
        if label not in times or off_label not in times:
            continue
        peak_on = _max_bytes(recs)
        peak_off = _max_bytes(records[off_label])
        out.append(
            {
                "schedule": v.schedule,
                "policy": v.policy,
                "recompute": v.recompute,
                "without": off_label,
                "with": label,
                "speedup": speedup(times[off_label], times[label]).as_dict(),
                "peak_step_bytes_without": peak_off,
                "peak_step_bytes_with": peak_on,
                "memory_ratio": peak_on / peak_off if peak_on and peak_off else None,
            }
        )
    return out


def _max_bytes(records: Sequence[VariantRecord]) -> int | None:
    """The largest rank's step peak (None if no rank measured one)."""
    return _largest(r.peak_step_bytes for r in records)


def _largest(values: Iterable[int | None]) -> int | None:
    """The largest of the known values (None if none is known)."""
    return max((v for v in values if v is not None), default=None)


def _against_baseline(times: Mapping[str, list[float]]) -> list[dict[str, Any]]:
    """Every twobp variant against the same variant of the baseline revision."""
    prefix = matrix.BASELINE + " "
    out = []
    for label in times:
        if not label.startswith(prefix):
            continue
        ours = matrix.TWOBP + " " + label.removeprefix(prefix)
        if ours in times:
            out.append(
                {
                    "twobp": ours,
                    "baseline": label,
                    "speedup": speedup(times[label], times[ours]).as_dict(),
                }
            )
    return out


def _same_schedule(times: Mapping[str, list[float]]) -> list[dict[str, Any]]:
    """twobp against torch on the same schedule, without and with 2BP."""
    out = []
    for ours, theirs in matrix.SAME_SCHEDULE.items():
        torch_label = matrix.Variant(matrix.TORCH, theirs).label
        if torch_label not in times:
            continue
        for label in sorted(t for t in times if t.split(" ")[1].split("+")[0] == ours):
            if not label.startswith(matrix.TWOBP + " "):
                continue
            out.append(
                {
                    "twobp": label,
                    "torch": torch_label,
                    "speedup": speedup(times[torch_label], times[label]).as_dict(),
                }
            )
    return out


def _fastest(
    variants: Sequence[Mapping[str, Any]], keep: Callable[[Mapping[str, Any]], bool]
) -> Mapping[str, Any] | None:
    """The variant of least median step time among those that ran and ``keep`` takes."""
    ran = [v for v in variants if "step_s" in v and keep(v)]
    return min(ran, key=lambda v: v["step_s"]["median"], default=None)


def _best(
    variants: Sequence[Mapping[str, Any]], times: Mapping[str, list[float]]
) -> dict[str, Any]:
    """The fastest twobp, torch and DeepSpeed variants and twobp's speedup over the other two
    (``speedup``: over torch; ``deepspeed_speedup``: over DeepSpeed, where it ran)."""
    ours = _fastest(variants, lambda v: v["framework"] == matrix.TWOBP)
    theirs = _fastest(variants, lambda v: v["framework"] == matrix.TORCH)
    deepspeed = _fastest(variants, lambda v: v["framework"] == matrix.DEEPSPEED)
    out: dict[str, Any] = {
        "twobp": ours["label"] if ours else None,
        "torch": theirs["label"] if theirs else None,
        "deepspeed": deepspeed["label"] if deepspeed else None,
    }
    if ours and theirs:
        out["speedup"] = speedup(times[theirs["label"]], times[ours["label"]]).as_dict()
    if ours and deepspeed:
        out["deepspeed_speedup"] = speedup(
            times[deepspeed["label"]], times[ours["label"]]
        ).as_dict()
    return out


def _auto_against_fixed(
    variants: Sequence[Mapping[str, Any]], times: Mapping[str, list[float]]
) -> dict[str, Any] | None:
    """``schedule="auto"`` against the fastest twobp variant of a schedule given by name:
    that variant's time over auto's, round by round (None unless both ran). With both
    ``auto`` and ``auto-m`` (which also chooses the micro-batch count), the faster one."""

    def twobp(v: Mapping[str, Any], auto: bool) -> bool:
        chosen = v["schedule"] in (matrix.AUTO, matrix.AUTO_MICROBATCHES)
        return v["framework"] == matrix.TWOBP and chosen is auto

    auto = _fastest(variants, lambda v: twobp(v, True))
    best = _fastest(variants, lambda v: twobp(v, False))
    if auto is None or best is None:
        return None
    return {
        "auto": auto["label"],
        "chose": auto.get("chose"),
        "best_fixed": best["label"],
        "speedup": speedup(times[best["label"]], times[auto["label"]]).as_dict(),
    }


def summary_of(data: Mapping[str, Any] | None) -> Summary | None:
    """A :class:`Summary` back from its dictionary (None stays None)."""
    return None if data is None else Summary(**data)


def finite(x: Any) -> bool:
    """True for a real number that is not NaN or infinite."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def _finite(value: float | None) -> float | None:
    """``value``, or None where it is not a finite number."""
    return value if value is not None and math.isfinite(value) else None
