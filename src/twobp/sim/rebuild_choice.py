"""``recompute="auto"`` on a schedule by name: the default, unless it does not fit (no torch).

A pipeline given a schedule by name, ``recompute="auto"`` and a
``memory_limit`` runs what it would run without ``recompute="auto"``: the
same schedule, 2BP stages, policy and partition. :func:`rebuild_to_fit`
simulates that default; where its predicted peak fits the limit it is
returned unchanged, since a rebuild only adds work and a limit that is met
asks for nothing else. Only where it is over the limit are stashes rebuilt,
the fewest that fit, on that same schedule
(:func:`twobp.sim.rebuild.fewest_rebuilds`). Where the default's 2BP stages
were the pipeline's own choice (``two_bp=None``), the same schedule with
fewer of them split holds fewer stashes: each that fits as it is is a
contender too, and the fastest predicted runs: the recompute dimension of
the one search (:mod:`twobp.sim.search`) on the pipeline's own schedule, each
contender simulated as it simulates options (:func:`twobp.sim.search.simulate_prepared`)
and ranked as it ranks them (:func:`twobp.sim.search.rank`). :class:`RebuildChoice`
keeps the predictions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from twobp.schedule.schedule import Schedule
from twobp.sim.cost_io import format_amount
from twobp.sim.costs import CostModel
from twobp.sim.from_profile import CostsFor
from twobp.sim.rebuild import RebuildError, rebuild_count
from twobp.sim.search import Candidate, fits, rank, simulate_prepared

__all__ = ["RebuildChoice", "rebuild_to_fit"]


@dataclass(frozen=True)
class RebuildChoice:
    """What ``recompute="auto"`` made of a schedule, and the predictions it chose by.

    Args:
        schedule: the schedule that runs: the default itself where it fits;
            else the default with the rebuilt micro-batches' ``I`` and ``W``
            turned into ``IR`` and ``WR``, or one with fewer stages split
            that fits as it is, whichever is predicted faster.
        default: the schedule the pipeline runs without ``recompute="auto"``.
        memory_limit: memory per rank (the cost model's unit).
        peak: the default's predicted peak memory (the largest rank's).
        step: the default's predicted step time.
        chosen_peak: the predicted peak of ``schedule``.
        chosen_step: the predicted step time of ``schedule``.
        alternative: the position in ``fewer_split`` of the schedule that
            runs (:func:`rebuild_to_fit`); None: the default, rebuilt or not.
    """

    schedule: Schedule
    default: Schedule
    memory_limit: float
    peak: float
    step: float
    chosen_peak: float
    chosen_step: float
    alternative: int | None = None

    @property
    def rebuilds(self) -> int:
        """How many stashes ``schedule`` rebuilds (its ``IR`` actions)."""
        return rebuild_count(self.schedule)

    def summary(self) -> str:
        """One line: kept, rebuilt or fewer stages split, and the predicted peaks and steps."""
        limit = format_amount(self.memory_limit)
        if self.schedule is self.default:
            return (
                f"recompute='auto': nothing rebuilt, {self.default.name} fits "
                f"memory_limit={limit} as it is (predicted peak {format_amount(self.peak)} "
                "per rank)"
            )
        ran = (
            f"{self.rebuilds} stashes rebuilt"
            if self.schedule.name == self.default.name
            else f"{self.schedule.name} instead, {self.rebuilds} stashes rebuilt"
        )
        slower = self.chosen_step / self.step if self.step > 0 else 1.0
        return (
            f"recompute='auto': {self.default.name} is over memory_limit={limit} (predicted "
            f"peak {format_amount(self.peak)} per rank): {ran}, predicted peak "
            f"{format_amount(self.chosen_peak)}, step {slower:.2f}x the default's"
        )


def rebuild_to_fit(
    default: Schedule,
    costs: CostModel | CostsFor,
    memory_limit: float,
    data_parallel: int = 1,
    fewer_split: Iterable[Schedule] = (),
) -> RebuildChoice:
    """The default schedule if its predicted peak fits; else the fastest predicted of it
    with the fewest stashes rebuilt that fit and each of ``fewer_split`` that fits as it is.

    Args:
        default: the prepared compute schedule a pipeline runs without
            ``recompute="auto"`` (:func:`twobp.schedule.prepare.prepare`).
        costs: the cost model of the model's stages, or of the model cut into
            a given number of stages, with memory sizes; fitted to each
            schedule as the planner fits it (:func:`twobp.sim.candidate.fit_costs`).
        memory_limit: memory per rank, in the cost model's unit.
        data_parallel: copies of the pipeline (they time its reductions).
        fewer_split: the default with fewer of its stages split, where the
            pipeline chose them (``two_bp=None``); read only if the default
            does not fit (a generator builds them only then).

    Returns:
        The choice: ``default`` itself (the same object) where it fits.

    Raises:
        RebuildError: if neither the default with rebuilt stashes nor any of
            ``fewer_split`` fits (the message names the rank and what it needs).
        ValueError: if the costs do not fit a schedule.
    """

    def predict(schedule: Schedule) -> Candidate:
        return simulate_prepared(schedule, costs, data_parallel=data_parallel)[0]

    kept = predict(default)
    step, peak = kept.makespan, kept.peak_memory
    if fits(kept, memory_limit):
        return RebuildChoice(default, default, memory_limit, peak, step, peak, step)
    # Each contender: its prediction, its schedule, its position in fewer_split.
    found: list[tuple[Candidate, Schedule, int | None]] = [
        (predict(other), other, position) for position, other in enumerate(fewer_split)
    ]
    try:
        rebuilt, schedule = simulate_prepared(
            default, costs, data_parallel=data_parallel, rebuild_within=memory_limit
        )
    except RebuildError:
        if not any(fits(c, memory_limit) for c, _, _ in found):
            raise
    else:
        found.append((rebuilt, schedule, None))
    best = rank([c for c, _, _ in found], memory_limit)[0]
    chosen, alternative = next((s, p) for c, s, p in found if c is best)
    return RebuildChoice(
        chosen,
        default,
        memory_limit,
        peak,
        step,
        best.peak_memory,
        best.makespan,
        alternative,
    )
