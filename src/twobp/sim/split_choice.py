"""Which stages 2BP pays on: split a stage's backward only where the simulator says so.

Splitting a stage's backward into ``I`` and ``W`` has a price: the 2BP engine
makes the stage's ``F`` and its ``I`` + ``W`` slower than a plain forward and
a fused ``B`` (a profile measures both: ``forward`` against
``forward_full``, ``backward_input + backward_weight`` against
``backward_full``). What it buys is the idle time its deferred ``W`` fill.
On small layers the price can exceed the idle time, and the split step is
slower than the fused one.

:func:`choose_split` searches the split stages of the schedule (the ``split``
dimension of :class:`twobp.sim.search.Option`: each stage of the model split
or fused, every replica of a stage alike) with :func:`twobp.sim.search.search`
under one cost model, and keeps the fastest. Where several are within
``margin`` of the fastest (10%) it keeps the one that splits the fewest
stages: a fused stage holds nothing from ``I`` until ``W``, and a prediction
inside the profile's noise does not buy memory with nothing. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from twobp.schedule import Schedule
from twobp.sim.costs import CostModel
from twobp.sim.search import Option, search, splits

SPLIT_MARGIN = 0.10
"""How much faster (a share of the step) splitting more stages must be predicted to be.

A profile on a machine shared with other work moves by 10-20% from one start to the
next, and the simulator does not see every cost of a split stage: on the main job's
model a split the simulator predicted 9% faster ran slower, one predicted 12% faster
ran level with the fused step."""
EXHAUSTIVE_STAGES = 8
"""Up to this many stages every set of split stages is simulated; above, one stage at a
time is changed from the best so far (from all split and from none)."""


@dataclass(frozen=True)
class SplitChoice:
    """What :func:`choose_split` chose, and the predictions it chose by.

    Args:
        split: per stage of the model, True if its backward is split (2BP).
        step: the predicted step time of the choice (the cost model's unit).
        fused_step: predicted with every stage fused (no 2BP).
        split_step: predicted with every stage split.
        margin: how much faster a split must be predicted to be chosen (:data:`SPLIT_MARGIN`).
    """

    split: tuple[bool, ...]
    step: float
    fused_step: float
    split_step: float
    margin: float = SPLIT_MARGIN

    def summary(self) -> str:
        """One line: which stages split, the three predicted steps, and why, where the
        choice is not the fastest prediction."""
        stages = [s for s, b in enumerate(self.split) if b]
        which = (
            "every stage"
            if all(self.split)
            else "no stage"
            if not stages
            else "stage" + ("s " if len(stages) > 1 else " ") + ", ".join(map(str, stages))
        )
        line = (
            f"2BP on {which}: predicted step {self.step * 1e3:.4g} ms, against "
            f"{self.fused_step * 1e3:.4g} ms with no stage split and "
            f"{self.split_step * 1e3:.4g} ms with every stage split"
        )
        fastest = min(self.fused_step, self.split_step)
        if fastest < self.step and self.step > 0:
            line += (
                f" ({(1 - fastest / self.step) * 100:.1f}% faster predicted, within the "
                f"{self.margin:.0%} margin a split must beat: a prediction inside the "
                "profile's noise does not pay for the stashes a split holds)"
            )
        return line


def choose_split(
    schedule: Schedule,
    costs: CostModel,
    *,
    policy: str = "paper",
    microbatches_per_w: int | None = None,
    reduce: bool = False,
    data_parallel: int = 1,
    margin: float = SPLIT_MARGIN,
) -> SplitChoice:
    """The stages whose backward to split, by simulating each choice.

    Args:
        schedule: the compute-only schedule, sourced
            (:func:`twobp.schedule.prepare.source_schedule`).
        costs: its cost model, fitted to its stages (every pipeline's), with
            ``forward_full`` for the fused stages' forward where measured.
        policy: the 2BP policy that places the split stages' ``W``.
        microbatches_per_w: the most micro-batches one ``W`` covers (None: no cap).
        reduce: the stages reduce their gradients (``R``), as the pipeline will.
        data_parallel: copies of the pipeline, which time the reductions.
        margin: see :data:`SPLIT_MARGIN`.

    Returns:
        The choice and its predictions.

    Raises:
        ValueError: if the costs do not fit the schedule or the policy.
    """
    n = schedule.pipeline_stages
    steps: dict[tuple[bool, ...], float] = {}

    def simulated(choices: Sequence[tuple[bool, ...]]) -> None:
        options = [
            Option(schedule.name, policy, None, microbatches_per_w, split=s) for s in choices
        ]
        found = search(
            options,
            schedule.n_ranks,
            schedule.n_microbatches,
            costs,
            data_parallel=data_parallel,
            source=schedule,
            reduce=reduce,
        )
        for candidate in found:
            if not candidate.ok:
                raise ValueError(candidate.error)
            assert candidate.split is not None
            steps[candidate.split] = candidate.makespan

    def step(split: tuple[bool, ...]) -> float:
        if split not in steps:
            simulated([split])
        return steps[split]

    fused, every = (False,) * n, (True,) * n
    if n <= EXHAUSTIVE_STAGES:
        simulated(list(splits(n)))
    else:
        for start in (fused, every):
            _improve(start, step)
    best = min(steps.values())
    within = [s for s, t in steps.items() if t <= best * (1 + margin)]
    chosen = min(within, key=lambda s: (sum(s), steps[s]))
    return SplitChoice(chosen, steps[chosen], step(fused), step(every), margin)


def _improve(start: tuple[bool, ...], step: Callable[[tuple[bool, ...]], float]) -> None:
    """Flip one stage at a time from ``start`` while that makes the step faster."""
    current = start
    while True:
        flips: Sequence[tuple[bool, ...]] = [
            tuple(not b if i == k else b for i, b in enumerate(current))
            for k in range(len(current))
        ]
        better = min(flips, key=step)
        if step(better) >= step(current):
            return
        current = better
