"""``Pipeline(..., compile=True)``: each stage keeps its compiled blocks only where they are
faster than the same blocks run eagerly, as timed in the first training steps.

Whether compiling pays depends on the model, its sizes and the device: on one CPU thread a
compiled region's call costs more than the eager kernels it replaces where the tensors are
small, and a GPU gains from every fused kernel. A region timed alone on its first call
(:mod:`twobp.engine.region_choice`) finds its inputs in cache, as it would not in a step; so
the choice of a whole stage is made on the steps themselves. The first :data:`WARMUP`
training steps run compiled (dynamo compiles the blocks, their regions are measured); the
next ``2 * TRIALS`` alternate eager and compiled, each timing every stage's compute on this
rank (the spans of its actions); then each stage keeps the way whose fastest step was the
shorter. A step's compute is only ever lengthened by what else runs on the machine (another
rank on the same core, the system): by as much as a fifth of a step on a busy CPU, in any
step of either way, which a median of a few steps does not always leave out. Each rank
decides for its own stages: the gradients are the same either way, to rounding.

:func:`trial_mode` and :func:`choose` are the pure part; :class:`CompileTrial` switches the
stage, or its blocks where they were compiled one by one (a compiled module runs its
``_compiled_call_impl``; without it, its eager forward).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from torch import nn

from twobp.timeline import Span

log = logging.getLogger("twobp")

Way = Literal["compiled", "eager"]

StageMode = Literal["measured", "compiled"]
"""``compile={"stages": ...}``: each stage compiled or eager by the trial (``"measured"``),
or every stage compiled whatever it costs."""

STAGE_MODES: tuple[StageMode, ...] = ("measured", "compiled")

WARMUP = 2
"""Training steps run compiled first: dynamo compiles, each region is measured once."""

TRIALS = 5
"""Timed steps of each way, alternated after the warm-up."""


def trial_mode(k: int) -> Way | None:
    """How the trial's ``k``-th training step runs (from 0); None once the trial is over."""
    if k < WARMUP:
        return "compiled"
    j = k - WARMUP
    if j < 2 * TRIALS:
        return "eager" if j % 2 == 0 else "compiled"
    return None


def stage_seconds(spans: Iterable[Span], stages: Iterable[int]) -> dict[int, float]:
    """Each stage's compute in a step: the summed durations of its actions' spans."""
    seconds = dict.fromkeys(stages, 0.0)
    for span in spans:
        if span.action.stage in seconds:
            seconds[span.action.stage] += span.duration
    return seconds


def choose(eager_s: list[float], compiled_s: list[float]) -> Way:
    """The way whose fastest step is the shorter (eager where they tie: it compiles nothing)."""
    return "compiled" if min(compiled_s) < min(eager_s) else "eager"


class CompileTrial:
    """The trial of one rank's stages (see the module doc).

    Args:
        stages: the rank's stage modules (each a container of blocks), by stage index;
            the stage and each of its blocks take part if compiled in place
            (``module.compile``, :func:`~twobp.engine.compiled.compile_for_two_stage`).
        label: names the rank in the log.
    """

    def __init__(self, stages: Mapping[int, nn.Module], label: str = "") -> None:
        self._parts: dict[int, list[tuple[nn.Module, Callable[..., Any]]]] = {}
        for s, module in stages.items():
            compiled = []
            for part in (module, *module.children()):
                impl = getattr(part, "_compiled_call_impl", None)
                if impl is not None:
                    compiled.append((part, impl))
            if compiled:
                self._parts[s] = compiled
        self.label = label
        self.steps = 0
        """Training steps the trial has seen end."""
        self.times: dict[int, dict[Way, list[float]]] = {
            s: {"eager": [], "compiled": []} for s in self._parts
        }
        """Each stage's compute per timed step, seconds, by the way it ran."""
        self.choice: dict[int, Way | None] = dict.fromkeys(self._parts)
        """How each stage runs from the end of the trial on (None until then)."""

    def before_step(self) -> None:
        """Set every stage to the way this step runs."""
        way = trial_mode(self.steps)
        if way is not None:
            for s in self._parts:
                self._set(s, way)

    def after_step(self, spans: Iterable[Span]) -> None:
        """Note a training step that ended, timed by its spans; decide at the trial's end."""
        way = trial_mode(self.steps)
        if way is None:
            return
        if self.steps >= WARMUP:
            for s, seconds in stage_seconds(spans, self._parts).items():
                self.times[s][way].append(seconds)
        self.steps += 1
        if trial_mode(self.steps) is not None:
            return
        for s in self._parts:
            times = self.times[s]
            way = self.choice[s] = choose(times["eager"], times["compiled"])
            self._set(s, way)
            log.info(
                "%sstage %d runs %s: compute %.2f ms per step eager, %.2f ms compiled "
                "(the fastest of %d steps each; medians %.2f and %.2f ms)",
                self.label,
                s,
                way,
                min(times["eager"]) * 1e3,
                min(times["compiled"]) * 1e3,
                TRIALS,
                statistics.median(times["eager"]) * 1e3,
                statistics.median(times["compiled"]) * 1e3,
            )

    def _set(self, s: int, way: Way) -> None:
        for part, compiled in self._parts[s]:
            part._compiled_call_impl = compiled if way == "compiled" else None
