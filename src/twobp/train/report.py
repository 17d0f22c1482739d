"""The end-of-run report of ``twobp train``: figures, curves and the last step's timeline.

Writes into the output folder:

- ``report.md``: throughput, bubble ratio and peak memory per rank, loss figures;
- ``metrics.json``: the same and the whole loss curve, for machines;
- ``loss.png``: the training loss and the held-out loss;
- ``timeline.png`` and ``trace.json``: the last step as measured (open the trace
  in chrome://tracing or ui.perfetto.dev).

and, when the run starts, ``config.toml``: the options it runs with, which
``twobp train --config OUT/config.toml`` repeats (for ``--schedule auto``,
rewritten at the end with the choice in the place of ``auto``).

The report says what ran (:mod:`twobp.train.what_ran`): the schedule and, for
``auto``, its choice with the predicted and measured step, the copies, the
recompute mode, the precision and the gradient scaler. The bubble ratio is the
median over the recorded steps (``--log-every``), whose timelines are gathered.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twobp.config import to_toml
from twobp.runtime.setup.compile_trial import TRIALS, WARMUP
from twobp.timeline import bubble_ratio, makespan
from twobp.train.config import TrainConfig, run_name
from twobp.train.engine_summary import report_line
from twobp.train.loop import WARMUP_STEPS, RankResult
from twobp.train.what_ran import chosen_options
from twobp.viz import render_ascii, render_png, write_trace


def summarize(cfg: TrainConfig, results: Sequence[RankResult]) -> dict[str, Any]:
    """The run's figures from every rank's result (pure)."""
    lead = results[0]
    timed = lead.step_seconds[WARMUP_STEPS:] or lead.step_seconds
    seconds_per_step = statistics.median(timed) if timed else float("nan")
    samples_per_s = cfg.batch_size / seconds_per_step
    losses = lead.losses
    # Skipped steps (non-finite loss) stay in the curve but not in the means.
    finite = [x for x in losses if math.isfinite(x)] or [math.nan]
    window = max(1, min(10, len(finite) // 5 or 1))
    first = statistics.fmean(finite[:window])
    last = statistics.fmean(finite[-window:])
    ranks = sorted({s.rank for s in lead.spans}) or [r.rank for r in results]
    last_bubble = bubble_ratio(lead.spans) if lead.spans else float("nan")
    bubbles = _after_warmup(lead.bubbles)
    per_rank = _after_warmup(lead.bubbles_per_rank)
    return {
        "config": dataclasses.asdict(cfg),
        "data": lead.data_source,
        "precision": lead.precision,
        "steps_run": len(losses),
        "steps_this_run": len(lead.step_seconds),
        "resumed_from_step": lead.resumed_from,
        "skipped_steps": lead.skipped_steps,
        "loss_scale": lead.loss_scale,
        "loss_scale_state": lead.loss_scale_state or None,
        "overflow_steps": lead.overflow_steps,
        "checkpoint": lead.checkpoint or None,
        "checkpoint_seconds_median": (
            statistics.median(lead.save_seconds) if lead.save_seconds else None
        ),
        "seconds_per_step_median": seconds_per_step,
        "samples_per_s": samples_per_s,
        "tokens_per_s": (
            None if lead.tokens_per_sample is None else samples_per_s * lead.tokens_per_sample
        ),
        "loss_first": first,
        "loss_last": last,
        "loss_drop": first - last,
        "loss_window": window,
        "eval_loss": lead.eval_loss,
        "eval_losses": [list(pair) for pair in lead.eval_losses],
        "ran": lead.ran,
        "engine": report_line([r.engine for r in results]),
        "compile_choice": _compile_choice(results),
        "last_step_makespan_s": makespan(lead.spans),
        "bubble_ratio": statistics.median(bubbles) if bubbles else last_bubble,
        "bubble_ratio_steps": len(bubbles),
        "bubble_ratio_last_step": last_bubble,
        "bubble_ratio_per_rank": {
            r: (
                statistics.median(b[r] for b in per_rank if r in b)
                if any(r in b for b in per_rank)
                else bubble_ratio(lead.spans, r)
                if lead.spans
                else float("nan")
            )
            for r in ranks
        },
        "stages_per_rank": {r.rank: [list(s) for s in r.stages] for r in results},
        "step_times_per_rank": {r.rank: _per_step(r.step_times) for r in results},
        "peak_rss_bytes_per_rank": {r.rank: r.peak_rss_bytes for r in results},
        "peak_stashed_bytes_per_rank": {r.rank: r.peak_stashed_bytes for r in results},
        "memory_per_rank": {r.rank: dict(r.memory) for r in results},
        "parameters_per_rank": {r.rank: r.n_parameters for r in results},
        "stage_blocks": lead.stage_blocks,
        "losses": losses,
    }


def _after_warmup(values: Sequence[Any]) -> list[Any]:
    """The recorded steps' figures, less the first (which agrees shapes and warms up)
    while later ones exist."""
    return list(values[1:] if len(values) > 1 else values)


def _per_step(total: dict[str, float]) -> dict[str, float]:
    """``Pipeline.step_times`` summed over the steps, as the mean per step (pure)."""
    steps = total.get("steps", 0.0)
    if not steps:
        return {}
    return {name: value / steps for name, value in total.items() if name != "steps"}


CONFIG_FILE = "config.toml"


def write_config(cfg: TrainConfig, out: Path, ran: dict[str, Any] | None = None) -> Path:
    """Write the run's options to ``out/config.toml``; returns its path.

    Args:
        cfg: the run's options.
        out: the output folder.
        ran: what ran (:func:`twobp.train.what_ran.what_ran`); for an ``auto``
            run, its choice replaces ``auto`` so that the file repeats the same
            pipeline without choosing again.
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / CONFIG_FILE
    header = (
        "The options of a twobp train run (options left out had no value).\n"
        f"Repeat it with: twobp train --config {path}"
    )
    # --overwrite is a decision about the folder, not an option of the run: a repeat of the
    # run into the same folder asks again.
    options = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "overwrite"}
    if ran and ran.get("auto"):
        options.update(chosen_options(ran))
        header += (
            f"\nschedule = 'auto' chose {ran['auto']['choice']}; the options below are that "
            'choice (set schedule = "auto" to choose again)'
        )
    path.write_text(to_toml(options, header))
    return path


def write_report(cfg: TrainConfig, results: Sequence[RankResult], out: Path) -> dict[str, Any]:
    """Write every report file into ``out``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(cfg, results)
    lead = results[0]
    title = run_title(cfg, lead.ran)
    (out / "metrics.json").write_text(json.dumps(summary, indent=2, default=str))
    if cfg.schedule == "auto" and lead.ran.get("auto"):
        write_config(cfg, out, lead.ran)
    _loss_png(summary["losses"], lead.eval_losses, out / "loss.png", title)
    if lead.spans:
        render_png(
            lead.spans,
            out / "timeline.png",
            title=f"{title}: last step (measured)",
            waits=lead.waits,
        )
        write_trace(lead.spans, out / "trace.json", title=title)
    (out / "report.md").write_text(render_markdown(summary, lead, title))
    return summary


def run_title(cfg: TrainConfig, ran: dict[str, Any]) -> str:
    """``"llama-tiny 1f1b 2BP:paper"``: the model and the schedule that ran (``auto``'s
    choice, marked so) (pure)."""
    if not ran:
        return f"{run_name(cfg)} {cfg.schedule}" + (
            f" 2BP:{cfg.policy}" if cfg.two_bp is not False else ""
        )
    chosen = " (auto)" if ran.get("auto") else ""
    two_bp = f" 2BP:{ran['policy']}" if ran["two_bp"] else ""
    return f"{run_name(cfg)} {ran['schedule']}{two_bp}{chosen}"


def throughput(summary: dict[str, Any]) -> str:
    """``"146.9 samples/s, 9401 tokens/s"``, without tokens for images."""
    text = f"{summary['samples_per_s']:.1f} samples/s"
    if summary["tokens_per_s"] is not None:
        text += f", {summary['tokens_per_s']:.0f} tokens/s"
    return text


def render_markdown(summary: dict[str, Any], lead: RankResult, title: str) -> str:
    """The human report (pure)."""
    lines = [
        f"# twobp train: {title}",
        "",
        f"- data: {summary['data']}",
        *_ran_lines(summary.get("ran") or {}, summary["precision"] + _loss_scale_text(summary)),
        *_compile_lines(summary.get("compile_choice") or {}),
        *([f"- {summary['engine']}"] if summary.get("engine") else []),
        f"- steps: {summary['steps_run']}, median step {summary['seconds_per_step_median']:.4f} s",
        f"- throughput: {throughput(summary)}",
        f"- loss: {summary['loss_first']:.4f} (mean of first {summary['loss_window']} steps) -> "
        f"{summary['loss_last']:.4f} (mean of last {summary['loss_window']}), "
        f"drop {summary['loss_drop']:.4f}; held-out loss {summary['eval_loss']:.4f}",
        _bubble_line(summary),
        *_reliability_lines(summary),
        "",
        "| rank | stages (blocks) | parameters | bubble | peak RSS MiB | peak 2BP stash MiB |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for rank, rss in summary["peak_rss_bytes_per_rank"].items():
        stages = [
            f"{s}: {first}-{last}" if first >= 0 else f"{s}: -"
            for s, first, last in summary["stages_per_rank"].get(rank, [])
        ]
        lines.append(
            f"| {rank} | {'; '.join(stages)} | {summary['parameters_per_rank'][rank]:,} | "
            f"{summary['bubble_ratio_per_rank'].get(rank, float('nan')):.3f} | {rss / MIB:.0f} | "
            f"{summary['peak_stashed_bytes_per_rank'][rank] / MIB:.2f} |"
        )
    lines += _memory_lines(summary.get("memory_per_rank", {}))
    lines += _step_time_lines(summary.get("step_times_per_rank", {}))
    if lead.spans:
        lines += ["", "Last step:", "", "```", render_ascii(lead.spans, width=100), "```"]
    return "\n".join(lines) + "\n"


MEMORY_FIGURES = ("activations", "stash", "parameters", "optimizer", "peak")
MIB = 1024 * 1024


def memory_line(memory: dict[int, dict[str, int]]) -> str | None:
    """The memory table of the report as the one line ``twobp train`` prints, or None
    without figures (pure)."""
    if not any(memory.values()):
        return None
    return f"memory (MiB; {', '.join(MEMORY_FIGURES)}): " + "; ".join(
        f"rank {rank} " + ", ".join(_in_mib(figures, 1)) for rank, figures in memory.items()
    )


def _memory_lines(memory: dict[int, dict[str, int]]) -> list[str]:
    """The table of ``Pipeline.memory_stats`` per rank, the largest over the steps (pure)."""
    if not any(memory.values()):
        return []
    lines = [
        "",
        "Memory (MiB, the most over the steps; `Pipeline.memory_stats`):",
        "",
        "| rank | " + " | ".join(MEMORY_FIGURES) + " |",
        "|---:|" + "---:|" * len(MEMORY_FIGURES),
    ]
    for rank, figures in memory.items():
        lines.append(f"| {rank} | {' | '.join(_in_mib(figures, 2))} |")
    return lines


def _in_mib(figures: dict[str, int], digits: int) -> list[str]:
    """The :data:`MEMORY_FIGURES` of one rank in MiB (a missing one is 0)."""
    return [f"{figures.get(name, 0) / MIB:.{digits}f}" for name in MEMORY_FIGURES]


def _compile_choice(results: Sequence[RankResult]) -> dict[int, str]:
    """Every stage's way with ``--compile`` over the ranks that run it (data-parallel copies
    choose each on their own steps), ``"compiled/eager"`` where they differ (pure)."""
    ways: dict[int, set[str]] = {}
    for result in results:
        for s, way in result.compile_choice.items():
            ways.setdefault(s, set()).add(way or "not chosen yet")
    return {s: "/".join(sorted(w)) for s, w in sorted(ways.items())}


def _compile_lines(choice: dict[int, str]) -> list[str]:
    """``--compile``: how each stage ran its blocks, as its first steps chose (pure)."""
    if not choice:
        return []
    ways = ", ".join(f"stage {s} {way}" for s, way in sorted(choice.items()))
    steps = WARMUP + 2 * TRIALS
    return [f"- compiled blocks, kept per stage where its first {steps} steps ran faster: {ways}"]


def _why(partition_by: str | None) -> str:
    return "" if not partition_by or partition_by == "given" else f" ({partition_by})"


def _ran_lines(ran: dict[str, Any], precision: str) -> list[str]:
    """What ran: schedule, auto's choice and why, copies, recompute, precision, scaler (pure)."""
    if not ran:
        return [f"- precision: {precision}"]
    two_bp = f"with 2BP ({ran['policy']})" if ran["two_bp"] else "without 2BP"
    cap = "" if ran["weight_group_size"] is None else f", W groups <= {ran['weight_group_size']}"
    lines = [
        f"- schedule: {ran['schedule']} {two_bp}{cap}, {ran['stages_per_rank']} stage(s) per "
        f"rank, partition {ran['partition']}{_why(ran.get('partition_by'))}; "
        f"{ran['data_parallel']} data-parallel "
        f"cop{'y' if ran['data_parallel'] == 1 else 'ies'}; recompute: {ran['recompute']}",
    ]
    if ran.get("two_bp_choice"):
        lines.append(f"- chosen by a profile (two_bp unset): {ran['two_bp_choice']}")
    if ran.get("rebuild_choice"):
        lines.append(f"- {ran['rebuild_choice']}")
    auto = ran.get("auto")
    if auto:
        measured = auto["measured_step_s"]
        lines.append(
            f"- chosen by schedule='auto': {auto['choice']}, predicted step "
            f"{auto['predicted_step_s'] * 1e3:.4g} ms, "
            + (
                f"measured {measured * 1e3:.4g} ms in trial steps (fastest of {auto['tried']} "
                "tried)"
                if measured is not None
                else "no trial steps (no other contender close enough)"
            )
            + f"; best of {auto['simulated']} simulated"
        )
    lines.append(f"- precision: {precision}; gradient scaler: {ran['scaler']}")
    return lines


def _bubble_line(summary: dict[str, Any]) -> str:
    steps = summary.get("bubble_ratio_steps", 0)
    if not steps:
        return f"- bubble ratio of the last step (measured): {summary['bubble_ratio']:.3f}"
    return (
        f"- bubble ratio (measured): {summary['bubble_ratio']:.3f}, the median over {steps} "
        f"recorded step(s) (last step {summary['bubble_ratio_last_step']:.3f})"
    )


STEP_TIMES = ("compute", "dispatch", "sending", "receiving")


def _step_time_lines(times: dict[int, dict[str, float]]) -> list[str]:
    """The table of ``Pipeline.step_times`` per rank, the mean per step (pure)."""
    if not any(times.values()):
        return []
    lines = [
        "",
        "Where a step went (ms per step, the mean over the steps; `Pipeline.step_times`: "
        "receiving includes waiting on peers; W parts in waits: layers' W run while a "
        "receive's data had not arrived (policy dynamic); waited with W queued: receiving "
        "while W whose I had run were held):",
        "",
        "| rank | " + " | ".join(STEP_TIMES) + " | sends | receives | W parts in waits "
        "| waited with W queued |",
        "|---:|" + "---:|" * (len(STEP_TIMES) + 4),
    ]
    for rank, figures in times.items():
        cells = [f"{figures.get(name, 0.0) * 1e3:.2f}" for name in STEP_TIMES]
        counts = [f"{figures.get(n, 0.0):.0f}" for n in ("sends", "receives", "weights_in_waits")]
        queued = f"{figures.get('waited_with_weights_queued', 0.0) * 1e3:.2f}"
        lines.append(f"| {rank} | {' | '.join(cells + counts)} | {queued} |")
    return lines


def _reliability_lines(summary: dict[str, Any]) -> list[str]:
    """Resume, skipped steps and checkpoint lines of the report (pure)."""
    lines = []
    if summary["resumed_from_step"] is not None:
        lines.append(
            f"- resumed from step {summary['resumed_from_step']}; "
            f"{summary['steps_this_run']} steps in this run"
        )
    if summary["skipped_steps"]:
        steps = ", ".join(map(str, summary["skipped_steps"][:20]))
        more = " ..." if len(summary["skipped_steps"]) > 20 else ""
        lines.append(
            f"- {len(summary['skipped_steps'])} steps skipped for a non-finite loss: {steps}{more}"
        )
    if summary["checkpoint"]:
        seconds = summary["checkpoint_seconds_median"]
        lines.append(f"- checkpoint: {summary['checkpoint']} (median save {seconds:.3f} s)")
    return lines


def _loss_scale_text(summary: dict[str, Any]) -> str:
    """``"; dynamic loss scale, 32768 at the end, 2 steps skipped for an overflow (0, 1)"``."""
    if summary["loss_scale"] is None:
        return ""
    scale = summary["loss_scale_state"]["scale"]
    text = f"; {summary['loss_scale']} loss scale, {scale:g} at the end"
    steps = summary["overflow_steps"]
    if steps:
        shown = ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "")
        text += f", {len(steps)} steps skipped for an overflow ({shown})"
    return text


def _loss_png(
    losses: Sequence[float], held_out: Sequence[tuple[int, float]], path: Path, title: str
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(range(1, len(losses) + 1), losses, lw=1, label="training loss")
    if held_out:
        steps, values = zip(*held_out, strict=True)
        ax.plot(steps, values, "o-", ms=3, lw=1, label="held-out loss")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title}: loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
