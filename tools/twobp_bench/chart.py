"""The bench's bar chart: samples per second of every variant (matplotlib, Agg).

One panel per regime and micro-batch count; one horizontal bar per variant
(median, with the interquartile range as an error bar), coloured by kind:
twobp without 2BP, twobp with 2BP, the baseline revision's twobp,
torch.distributed.pipelining, DeepSpeed. Dashed
lines mark what ``p`` ranks would reach at the speed of each single-process
reference. matplotlib is imported inside :func:`render_chart` and drawn
without ``pyplot``, so no global state is left behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

COLOURS = {
    "twobp": "#56B4E9",
    "twobp+2bp": "#009E73",
    "torch": "#E69F00",
    "baseline": "#999999",
    "deepspeed": "#CC79A7",
}
REFERENCE_STYLES = {"microbatched": ":", "whole-batch": "--", "2bp-limit": "-."}


def _colour(variant: Mapping[str, Any]) -> str:
    if variant["framework"] in ("torch", "baseline", "deepspeed"):
        return COLOURS[variant["framework"]]
    return COLOURS["twobp+2bp" if variant["two_bp"] else "twobp"]


def render_chart(results: Mapping[str, Any], path: str | Path) -> Path:
    """Draw the chart of ``results`` (the bench's dictionary) into ``path``.

    Returns:
        The path written.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [(r, g) for r in results["regimes"] for g in r["groups"]]
    n_bars = max((len(g["variants"]) for _, g in panels), default=1)
    cols = max(1, len({g["n_microbatches"] for _, g in panels}))
    rows = max(1, -(-len(panels) // cols))
    height = 0.32 * n_bars * rows + 1.5 * rows
    figure = Figure(figsize=(5.5 * cols, height))
    for index, (regime, group) in enumerate(panels):
        axes = figure.add_subplot(rows, cols, index + 1)
        ran = [v for v in group["variants"] if v["framework"] != "reference" and "step_s" in v]
        medians = [v["samples_per_s"]["median"] for v in ran]
        errors = [
            [m - v["samples_per_s"]["q1"] for m, v in zip(medians, ran, strict=True)],
            [v["samples_per_s"]["q3"] - m for m, v in zip(medians, ran, strict=True)],
        ]
        positions = list(range(len(ran)))[::-1]
        axes.barh(positions, medians, xerr=errors, color=[_colour(v) for v in ran], capsize=2)
        axes.set_yticks(positions)
        axes.set_yticklabels([v["label"] for v in ran], fontsize=7)
        for name, bound in group["reference_bounds_s"].items():
            axes.axvline(
                group["batch_size"] / bound,
                color="black",
                linestyle=REFERENCE_STYLES.get(name, "-"),
                linewidth=0.8,
                label=f"p x {name}",
            )
        axes.set_title(f"{regime['name']}, m = {group['n_microbatches']}", fontsize=9)
        axes.set_xlabel("samples/s", fontsize=8)
        axes.tick_params(axis="x", labelsize=7)
        if group["reference_bounds_s"]:
            axes.legend(fontsize=6, loc="lower right")
    handles = [
        Patch(color=COLOURS["twobp"], label="twobp, no 2BP"),
        Patch(color=COLOURS["twobp+2bp"], label="twobp, 2BP"),
        Patch(color=COLOURS["torch"], label="torch.distributed.pipelining"),
    ]
    ran = [v for _, g in panels for v in g["variants"] if "step_s" in v]
    if any(v["framework"] == "deepspeed" for v in ran):
        handles.append(Patch(color=COLOURS["deepspeed"], label="DeepSpeed PipelineEngine"))
    if results.get("baseline"):
        handles.append(Patch(color=COLOURS["baseline"], label=f"twobp {results['baseline']}"))
    # Two entries per panel's width fit on a line; the panels start below the legend's lines.
    per_line = min(len(handles), 2 * cols)
    lines = -(-len(handles) // per_line)
    figure.legend(handles=handles, loc="upper center", ncol=per_line, fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 1 - (0.2 * lines + 0.1) / height))
    out = Path(path)
    figure.savefig(out, dpi=100)
    return out
