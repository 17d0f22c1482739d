"""The bench's human report: markdown tables from the results dictionary (pure).

Sections: the 2BP table in the layout of the 2BP paper (throughput and memory
increase per model and schedule), twobp against its baseline revision (with
``--baseline``), twobp against torch.distributed.pipelining and DeepSpeed, the targets, then
per regime and micro-batch count a table of every variant and one of each
rank's bubble, CPU time and compute per action kind. This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from twobp_bench.targets import shown_value

MIB = 1024 * 1024
GRAD_TOLERANCE = 1e-3
"""Largest relative difference of a parameter's gradient (its norm and projections, over
its norm) still taken as the same gradients."""


def render_markdown(results: Mapping[str, Any]) -> str:
    """The whole report."""
    lines = ["# twobp bench", ""]
    lines += _header(results)
    lines += _paper_table(results["regimes"])
    lines += _memory_table(results["regimes"])
    if results.get("baseline"):
        lines += _versus_baseline(results["regimes"], results["baseline"])
    lines += _versus_torch(results["regimes"])
    lines += _targets(results.get("targets", []))
    for regime in results["regimes"]:
        lines += _regime(regime, results["n_ranks"])
    lines += _notes()
    return "\n".join(lines) + "\n"


def _header(results: Mapping[str, Any]) -> list[str]:
    machine = results["machine"]
    return [
        f"Command: `{results['command']}`",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores; {results['n_ranks']} ranks x "
        f"{results['threads']} thread(s); torch {machine['torch']}; load average "
        f"{_load(machine['load_before'])} before, {_load(machine['load_after'])} after; "
        f"{results['rounds']} timed rounds after {results['warmup']} warm-up rounds; "
        f"wall time {results['wall_s']:.0f} s.",
        "",
        *_copies(results),
        *(
            [
                "Shared model: this twobp's variants take turns on one copy of the model, each "
                "claiming it for its steps, as a training run holds one; torch variants and "
                "references have a copy each.",
                "",
            ]
            if results.get("share_model")
            else []
        ),
    ]


def _copies(results: Mapping[str, Any]) -> list[str]:
    copies = results.get("data_parallel", 1)
    if copies == 1:
        return []
    return [
        f"Data parallel: {copies} copies of every twobp pipeline ({copies} x {results['n_ranks']} "
        "processes), each on a batch of its own; the figures are those of copy 0, the global "
        f"throughput is {copies} times its samples/s. torch and reference variants do not run.",
        "",
    ]


def _load(values: Sequence[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return [*out, ""]


def _x(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}x"


def _ratio(summary: Mapping[str, Any] | None) -> str:
    """``1.23x [1.20-1.26]``: median and interquartile range of a ratio."""
    if summary is None:
        return "n/a"
    return f"{summary['median']:.2f}x [{summary['q1']:.2f}-{summary['q3']:.2f}]"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def _model_name(regime: Mapping[str, Any]) -> str:
    if regime.get("rows_per_gemm") is None:
        return f"{regime['name']} ({regime['microbatch_size']} samples/micro-batch)"
    return f"{regime['name']} ({regime['rows_per_gemm']} rows/GEMM)"


def _by_label(group: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {v["label"]: v for v in group["variants"]}


def _groups(
    regimes: Sequence[Mapping[str, Any]],
) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any], dict[str, Mapping[str, Any]]]]:
    """Every ``(regime, group, the group's variants by label)`` in report order."""
    for regime in regimes:
        for group in regime["groups"]:
            yield regime, group, _by_label(group)


def _paper_table(regimes: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = []
    for regime, group, variants in _groups(regimes):
        for pair in group["two_bp_speedups"]:
            off, on = variants[pair["without"]], variants[pair["with"]]
            rows.append(
                [
                    _model_name(regime),
                    pair["with"].removeprefix("twobp "),
                    str(group["n_microbatches"]),
                    f"{off['samples_per_s']['median']:.1f}",
                    f"{on['samples_per_s']['median']:.1f}",
                    _ratio(pair["speedup"]),
                    _mib(pair["peak_step_bytes_without"]),
                    _mib(pair["peak_step_bytes_with"]),
                    _x(pair["memory_ratio"]),
                ]
            )
    head = [
        "model",
        "schedule",
        "m",
        "samples/s no 2BP",
        "samples/s 2BP",
        "throughput increase [IQR]",
        "step peak MiB no 2BP",
        "step peak MiB 2BP",
        "memory increase",
    ]
    return ["## 2BP against no 2BP (twobp)", "", *_table(head, rows)]


def _memory_table(regimes: Sequence[Mapping[str, Any]]) -> list[str]:
    """Throughput and memory of every twobp variant: per schedule, 2BP and recompute mode."""
    rows = [
        [
            _model_name(regime),
            f"auto: {v['chose']}" if v.get("chose") else v["schedule"],
            str(group["n_microbatches"]),
            "on" if v["two_bp"] else "off",
            v.get("recompute") or "-",
            f"{v['samples_per_s']['median']:.1f}",
            _mib(peaks["step_bytes"]),
            _x(peaks["step_vs_no_2bp"]),
            _mib(peaks["activations_bytes"]),
            _mib(peaks["stash_bytes"]),
        ]
        for regime, group, _ in _groups(regimes)
        for v in group["variants"]
        if (peaks := v.get("memory_peaks"))
    ]
    if not rows:
        return []
    head = [
        "model",
        "schedule",
        "m",
        "2BP",
        "recompute",
        "samples/s",
        "step peak MiB",
        "peak vs no 2BP",
        "activations MiB",
        "stash MiB",
    ]
    return [
        "## Memory: schedule x 2BP x recompute (twobp)",
        "",
        "Step peak: the most any rank allocated in one step beyond what it held before; "
        "against the same schedule without 2BP and without recomputation (n/a for a "
        "natively split schedule, which has no such variant). Activations (held from F "
        "until I) and stash (from I until W): `Pipeline.memory_stats`, the largest rank.",
        "",
        *_table(head, rows),
    ]


def _versus_baseline(regimes: Sequence[Mapping[str, Any]], revision: str) -> list[str]:
    rows = [
        [
            _model_name(regime),
            str(group["n_microbatches"]),
            pair["twobp"],
            pair["baseline"],
            _ratio(pair["speedup"]),
        ]
        for regime in regimes
        for group in regime["groups"]
        for pair in group.get("against_baseline", [])
    ]
    head = ["model", "m", "twobp", "baseline", "twobp speedup [IQR]"]
    return [
        f"## twobp against its baseline (git revision `{revision}`)",
        "",
        "The same variant on both, next to each other in every round.",
        "",
        *_table(head, rows),
    ]


def _versus_torch(regimes: Sequence[Mapping[str, Any]]) -> list[str]:
    best_rows, same_rows, updates = [], [], []
    with_deepspeed = any(g["best"].get("deepspeed") for _, g, _ in _groups(regimes))
    for regime, group, variants in _groups(regimes):
        best = group["best"]
        if best.get("twobp") and (best.get("torch") or best.get("deepspeed")):
            ours = variants[best["twobp"]]
            row = [
                _model_name(regime),
                str(group["n_microbatches"]),
                best["twobp"],
                f"{ours['samples_per_s']['median']:.1f}",
                *_peer(variants, best.get("torch"), best.get("speedup")),
            ]
            if with_deepspeed:
                row += _peer(variants, best.get("deepspeed"), best.get("deepspeed_speedup"))
            best_rows.append(row)
        for pair in group["same_schedule"]:
            same_rows.append(
                [
                    _model_name(regime),
                    str(group["n_microbatches"]),
                    pair["twobp"],
                    pair["torch"],
                    _ratio(pair["speedup"]),
                ]
            )
        for v in group["variants"]:
            if v.get("update_s"):
                updates.append(
                    f"{regime['name']}, m = {group['n_microbatches']}: "
                    + " / ".join("-" if t is None else f"{t * 1e3:.1f}" for t in v["update_s"])
                    + f" ms of {v['step_s']['median'] * 1e3:.1f} ms"
                )
    if not (best_rows or same_rows):
        return []
    head = ["model", "m", "best twobp", "samples/s", "best torch", "samples/s", "speedup [IQR]"]
    if with_deepspeed:
        head += ["DeepSpeed", "samples/s", "speedup over DeepSpeed [IQR]"]
    same_head = ["model", "m", "twobp", "torch", "twobp speedup [IQR]"]
    title = "## twobp against torch.distributed.pipelining"
    lines = [
        title + (" and DeepSpeed" if with_deepspeed else ""),
        "",
        *_table(head, best_rows),
    ]
    beside = sorted(
        {
            label.rsplit(" m=", 1)[1]
            for _, group, variants in _groups(regimes)
            for label in variants
            if label.startswith("torch ") and " m=" in label
        },
        key=int,
    )
    if beside:
        lines += [
            "`auto-m` chooses how many micro-batches the batch is cut into, so torch's schedules "
            f"also ran on the same batch cut into the other counts it chooses among (m = "
            f"{', '.join(beside)}; labelled `m=K`): the best torch is the fastest of every count.",
            "",
        ]
    if updates:
        lines += [
            "A DeepSpeed step (`PipelineEngine.train_batch`) ends with its optimizer step, which "
            "the other variants' steps do not have: SGD at learning rate 0 (every parameter "
            "updated, the weights unchanged) and DeepSpeed's `zero_grad`. The update took, per "
            "rank (rank 0 / rank 1 / ...): " + "; ".join(updates) + ".",
            "",
        ]
    return [*lines, "Same schedule order:", "", *_table(same_head, same_rows)]


def _peer(
    variants: Mapping[str, Mapping[str, Any]], label: str | None, ratio: Mapping[str, Any] | None
) -> list[str]:
    """A peer framework's best variant, its samples/s and twobp's speedup over it."""
    if label is None:
        return ["n/a", "n/a", "n/a"]
    return [label, f"{variants[label]['samples_per_s']['median']:.1f}", _ratio(ratio)]


def _targets(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = []
    for t in targets:
        shown = "n/a" if t["value"] is None else shown_value(t)
        sign = ">=" if t["above"] else "<="
        threshold = "-" if t["threshold"] is None else f"{sign} {t['threshold']}"
        met = {True: "met", False: "MISSED", None: "-"}[t["met"]]
        bound = t.get("bound")
        bounded = "-" if bound is None else f"{bound:.3f}"
        rows.append([t["regime"], t["target"], shown, threshold, met, bounded, t["detail"]])
    head = ["regime", "target", "value", "threshold", "", "bound", "detail"]
    return [
        "## Targets",
        "",
        *_table(head, rows),
        "",
        "Bound: the most the other figures of the run allow. Over torch: the best torch step "
        "over the efficiency reference / p (a twobp pipeline without bubble or overhead). "
        "A target above this bound is out of reach of any runtime on this machine. "
        "2BP over no 2BP: the simulator's ratio of the two schedules under the profiled costs, "
        "what the schedule change alone gives (an estimate, not a hard limit).",
    ]


def _regime(regime: Mapping[str, Any], n_ranks: int) -> list[str]:
    model = ", ".join(f"{k}={v}" for k, v in regime["model"].items())
    lines = [
        f"## Regime {regime['name']}",
        "",
        f"{regime['description']}. Model: {model}; blocks: {', '.join(regime['block_kinds'])}; "
        f"{regime['microbatch_size']} samples per micro-batch; device {regime['device']}, "
        f"{regime['threads']} thread(s) per rank; peak RSS per rank "
        f"{', '.join(_mib(b) for b in regime['peak_rss_bytes'])} MiB (whole job).",
        "",
    ]
    profile = next((g["profile"] for g in regime["groups"] if g.get("profile")), None)
    if profile is not None:
        bandwidth = profile["link_bandwidth_bytes_per_s"]
        shown = (
            "bandwidth not measured (a large message took no longer than a small one)"
            if bandwidth is None or not math.isfinite(bandwidth)
            else f"{bandwidth / 1e9:.2f} GB/s"
        )
        lines += [
            f"Link rank 0 - rank 1 (ping-pong): {profile['link_latency_s'] * 1e6:.0f} us one way, "
            f"{shown}.",
            "",
        ]
        contention = [g["profile"].get("contention") for g in regime["groups"] if g.get("profile")]
        if contention and all(isinstance(c, (int, float)) for c in contention):
            lines += [
                "Contention (the same block's F and B on all ranks at once / on each alone, "
                "median of the rounds), per micro-batch count: "
                + _per_count(contention, lambda c: f"{c:.2f}")
                + ".",
                "",
            ]
        sends = [g.get("send_overhead_s") for g in regime["groups"]]
        if any(sends):
            lines += [
                "A send to another rank holds its sender (twobp's own sends, median of every "
                "variant, rank and round), per micro-batch count: "
                + _per_count(sends, lambda t: f"{t * 1e6:.0f} us")
                + ". The simulator charges it to the action whose result crosses.",
                "",
            ]
        outside = [g.get("step_overhead_s") for g in regime["groups"]]
        if any(outside):
            lines += [
                "A step spends time outside its schedule (the all-reduce that opens it, "
                "splitting the batch, settling the loss; median of twobp's variants and "
                "rounds), per micro-batch count: "
                + _per_count(outside, lambda t: f"{t * 1e3:.1f} ms")
                + ". The simulator check and the replay add it to the schedule's makespan.",
                "",
            ]
        # Measured once per regime: every micro-batch count has the same figure.
        reduce = profile.get("reduce_bandwidth_bytes_per_s")
        if isinstance(reduce, float) and math.isfinite(reduce):
            lines += [
                f"An all-reduce over every rank moved {reduce / 1e9:.2f} GB/s per rank "
                "(a point-to-point message is faster: the ranks also sum and copy). The "
                "simulator costs the R of replicated stages with it.",
                "",
            ]
    for group in regime["groups"]:
        lines += _group(group, n_ranks)
    return lines


def _per_count(values: Sequence[float | None], shown: Callable[[float], str]) -> str:
    """One figure per micro-batch count, comma-separated (a missing one as 0)."""
    return ", ".join(shown(v or 0.0) for v in values)


def _group(group: Mapping[str, Any], n_ranks: int) -> list[str]:
    bounds = group["reference_bounds_s"]
    names = list(bounds)
    head = [
        "variant",
        "partition",
        "step ms [IQR]",
        "samples/s",
        "bubble",
        "busy ms (sim)",
        *[f"eff. vs {n}" for n in names],
        "sim ms",
        "sim error",
        "replay error",
        "step peak MiB/rank",
        "W stash MiB/rank",
        "grad check",
    ]
    rows, skipped = [], []
    for v in group["variants"]:
        if "step_s" not in v:
            skipped.append(f"- {v['label']}: {v['skipped'] or 'no timed step'}")
            continue
        step = v["step_s"]
        efficiency = v.get("efficiency", {})
        rows.append(
            [
                v["label"],
                "-".join(map(str, v["partition"])) if v["framework"] != "reference" else "all",
                f"{step['median'] * 1e3:.1f} [{step['q1'] * 1e3:.1f}-{step['q3'] * 1e3:.1f}]",
                f"{v['samples_per_s']['median']:.1f}",
                "n/a" if v.get("bubble_ratio") is None else f"{v['bubble_ratio']:.3f}",
                _busy(v),
                *["-" if efficiency.get(n) is None else f"{efficiency[n]:.2f}" for n in names],
                "-" if v.get("sim_step_s") is None else f"{v['sim_step_s'] * 1e3:.1f}",
                "-" if v.get("sim_error") is None else f"{v['sim_error'] * 100:+.1f}%",
                "-" if v.get("replay_error") is None else f"{v['replay_error'] * 100:+.1f}%",
                _per_rank_mib(v.get("peak_step_bytes")),
                _per_rank_mib(v.get("stashed_bytes")),
                _grad_check(v.get("grad_rel_error")),
            ]
        )
    bound_text = ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in bounds.items())
    lines = [
        f"### m = {group['n_microbatches']} (batch {group['batch_size']})",
        "",
    ]
    if bounds:
        lines += [f"Reference time / p (p = {n_ranks}): {bound_text}.", ""]
    lines += _table(head, rows)
    auto = group.get("auto")
    if auto:
        lines += [
            "",
            f"`{auto['auto']}` ran {auto['chose'] or 'an unrecorded choice'}; the fastest "
            f"fixed variant, {auto['best_fixed']}, took "
            f"{_ratio(auto['speedup'])} its step time, round by round.",
            "",
        ]
    if skipped:
        lines += ["Skipped:", "", *skipped, ""]
    lines += _per_rank(group)
    return lines


def _per_rank(group: Mapping[str, Any]) -> list[str]:
    """Each rank's bubble, CPU time and compute per action kind, of every variant that ran."""
    rows = []
    for v in group["variants"]:
        cpu = v.get("cpu_s") or []
        if not any(c is not None for c in cpu):
            continue
        bubbles = v.get("rank_bubble")
        rows.append(
            [
                v["label"],
                " / ".join("-" if c is None else f"{c * 1e3:.0f}" for c in cpu),
                "-" if not bubbles else " / ".join(f"{b:.1%}" for b in bubbles),
                _kinds(v.get("rank_compute_s")),
            ]
        )
    if not rows:
        return []
    head = ["variant", "CPU ms per rank", "bubble per rank", "compute ms per kind, per rank"]
    return ["Per rank (rank 0 / rank 1 / ...):", "", *_table(head, rows)]


def _kinds(per_rank: Sequence[Mapping[str, float]] | None) -> str:
    """``F 47 / 52, B 87 / 87``: milliseconds of each kind on each rank."""
    if not per_rank:
        return "-"
    kinds = sorted({k for rank in per_rank for k in rank}, key="FBIW".find)
    return ", ".join(
        f"{k} " + " / ".join(f"{rank.get(k, 0.0) * 1e3:.0f}" for rank in per_rank) for k in kinds
    )


def _busy(variant: Mapping[str, Any]) -> str:
    """Measured compute time per rank, and the simulator's in brackets."""
    if variant.get("busy_s") is None:
        return "n/a"
    text = f"{variant['busy_s'] * 1e3:.1f}"
    if variant.get("sim_busy_s") is not None:
        text += f" ({variant['sim_busy_s'] * 1e3:.1f})"
    return text


def _per_rank_mib(values: Sequence[float | None] | None) -> str:
    if not values or all(v is None for v in values):
        return "-"
    return " / ".join(_mib(v) for v in values)


def _grad_check(error: float | None) -> str:
    if error is None:
        return "-"
    return ("ok " if error <= GRAD_TOLERANCE else "DIFFERS ") + f"{error:.0e}"


def _notes() -> list[str]:
    return [
        "## How this was measured",
        "",
        "- Every variant runs on its own copy of the same model (same seed), the same batch, the "
        "same partition for the same number of stages, and the same threads per rank.",
        "- Variants run in turn (A B C A B C ...), round after round; the step time is the median "
        "over rounds, from a barrier before the step to a barrier after it; [IQR] is the "
        "interquartile range. Speedups are medians of round-by-round ratios.",
        "- A step is the forward and backward of every micro-batch (no optimizer).",
        "- torch.distributed.pipelining runs with the loss scaled by 1/m and "
        "`scale_grads=False` (the same gradients as twobp, without an extra pass over them) and "
        "`return_outputs=False`.",
        "- DeepSpeed (where installed) runs its `PipelineEngine` on the same stage modules and "
        "micro-batches: one step is `train_batch`, its 1F1B `TrainSchedule`, which ends with "
        "an optimizer step (SGD at learning rate 0, timed on its own and given above) and "
        "`zero_grad`; its gradient all-reduce over a data-parallel group of one rank is off "
        "(the same gradients, without an extra pass over them).",
        "- References run on every rank at once, each rank alone with the whole model; the bound "
        "is their time divided by p. Efficiency = bound / step time.",
        "- Step peak: the most bytes allocated during the last warm-up step beyond what was held "
        "before it (activations, W stash, buffers, new gradients; not the parameters), read from "
        "torch.profiler's allocation events on the CPU, torch.cuda.max_memory_allocated on GPUs. "
        "With one warm-up round this is each variant's first step, so buffers made once and kept "
        "(torch's receive buffers) count too.",
        "- Bubble and busy: idle fraction of the step and compute time per rank (mean over "
        "ranks), from the twobp runtime's own timeline (n/a for torch); in brackets the "
        "simulator's busy time: where the two differ, the profiled costs are off; where they "
        "agree and the step times do not, the schedule or communication model is.",
        "- Simulator: twobp.sim on the blocks' F, I, W, B times and the time of one W over all m "
        "micro-batches, profiled by every rank after each timed round (medians; each stage "
        "costed by the rank that runs it), and the measured link.",
        "- Replay: the same simulator on the step's own measured action times (means per "
        "stage and kind) and the order the ranks ran them in: its error is the simulator's "
        "model of dependencies and transfers alone, without the profile's.",
        "- Grad check: the largest difference of any parameter's gradient from the whole-batch "
        "reference's (its norm and two random projections), relative to that gradient's norm.",
        "- Per rank: the CPU time of each rank's process in the step (all its threads; well "
        "below the step time, the rank waited or other work on the machine held the cores), "
        "and, from the twobp runtime's timeline, each rank's bubble and compute time per "
        "action kind (mean per step).",
        "",
    ]
