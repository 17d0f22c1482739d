"""The variants a bench compares, their stage layout, and the order they run in.

A *variant* is one way to run a training step of the same model on the same
batch: a twobp schedule with or without 2BP (of this twobp, or of the twobp of
a baseline git revision), a ``torch.distributed.pipelining`` schedule, a
schedule of DeepSpeed's ``PipelineEngine``, or a single-process reference.
Every pipeline variant with the same number of stages gets the same partition
(:func:`stage_partition`), and the variants run in turn, round after round
(:func:`round_robin`), so that a change of machine load touches them all alike.
This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from twobp.partition import uniform
from twobp.schedule import SCHEDULES, Schedule, generate
from twobp.sim.search import microbatch_counts

TWOBP = "twobp"
BASELINE = "baseline"
"""twobp of the baseline git revision (``--baseline``), with this twobp's schedule names."""
TORCH = "torch"
DEEPSPEED = "deepspeed"
REFERENCE = "reference"
PIPELINES_OF_TWOBP = (TWOBP, BASELINE)
AUTO = "auto"
"""``schedule="auto"``: twobp chooses the schedule, 2BP policy and partition itself
(its placement is known once it is built)."""
AUTO_MICROBATCHES = "auto-m"
"""``schedule="auto", n_microbatches="auto"``: twobp also chooses how many micro-batches
the variant's batch is cut into (planned on the first step's batch)."""

REFERENCE_MICROBATCHED = "microbatched"
"""Reference (a): one process runs F and B of all m micro-batches of the whole model."""
REFERENCE_WHOLE_BATCH = "whole-batch"
"""Reference (b): one process runs F and B of the whole batch at once."""
REFERENCE_TWO_BP_LIMIT = "2bp-limit"
"""Reference (c): one process, F and I per micro-batch, one W over all of them."""
REFERENCES = (REFERENCE_MICROBATCHED, REFERENCE_WHOLE_BATCH, REFERENCE_TWO_BP_LIMIT)

REFERENCE_DESCRIPTIONS: Mapping[str, str] = MappingProxyType(
    {
        REFERENCE_MICROBATCHED: "(a) one process, same micro-batches, F+B of each",
        REFERENCE_WHOLE_BATCH: "(b) one process, whole batch without micro-batching",
        REFERENCE_TWO_BP_LIMIT: "(c) one process, F+I per micro-batch, one W over all",
    }
)


@dataclass(frozen=True)
class TorchScheduleInfo:
    """A ``torch.distributed.pipelining`` schedule as the bench builds it.

    Args:
        name: the class name without its ``Schedule`` prefix.
        stages_per_rank: stages each rank holds.
        placement: ``"loop"`` (stage ``s`` on rank ``s % p``) or ``"v"``
            (rank ``r`` holds stages ``r`` and ``2p - 1 - r``).
    """

    name: str
    stages_per_rank: int
    placement: str

    @property
    def class_name(self) -> str:
        """The class in ``torch.distributed.pipelining``."""
        return f"Schedule{self.name}"


SAME_SCHEDULE: Mapping[str, str] = MappingProxyType(
    {
        "gpipe": "GPipe",
        "1f1b": "1F1B",
        "interleaved-1f1b": "Interleaved1F1B",
        "zb-v": "ZBVZeroBubble",
        "dualpipev": "DualPipeV",
    }
)
"""twobp schedules and the torch schedule that runs the same order of F and B."""

TORCH_SCHEDULES: Mapping[str, TorchScheduleInfo] = MappingProxyType(
    {
        info.name: info
        for info in (
            TorchScheduleInfo("GPipe", 1, "loop"),
            TorchScheduleInfo("1F1B", 1, "loop"),
            TorchScheduleInfo("Interleaved1F1B", 2, "loop"),
            TorchScheduleInfo("InterleavedZeroBubble", 2, "loop"),
            TorchScheduleInfo("ZBVZeroBubble", 2, "v"),
            TorchScheduleInfo("DualPipeV", 2, "v"),
        )
    }
)
"""The torch schedules the bench knows, by name."""

DEEPSPEED_SCHEDULES: Mapping[str, str] = MappingProxyType({"1F1B": "TrainSchedule"})
"""DeepSpeed's pipeline schedules the bench knows: its name here and DeepSpeed's class.
``PipelineEngine.train_batch`` runs ``TrainSchedule`` (1F1B, one stage per rank)."""


@dataclass(frozen=True)
class Variant:
    """One way to run the step.

    Args:
        framework: ``"twobp"``, ``"baseline"``, ``"torch"``, ``"deepspeed"`` or
            ``"reference"``.
        schedule: the twobp, torch or DeepSpeed schedule name, or the reference name.
        two_bp: whether the backward is split into I and W.
        policy: the 2BP policy of a fused twobp schedule run with 2BP (else None).
        recompute: the twobp recompute mode of every stage (None: none).
        microbatches: the micro-batches it cuts the group's batch into, where
            not the group's own count (None): torch's schedules at the counts
            ``auto-m`` chooses among (:func:`counts_beside_auto`).
    """

    framework: str
    schedule: str
    two_bp: bool = False
    policy: str | None = None
    recompute: str | None = None
    microbatches: int | None = None

    @property
    def label(self) -> str:
        """A short unique name: ``twobp 1f1b+2bp``, ``torch 1F1B``, ``torch 1F1B m=4``,
        ``reference whole-batch``."""
        suffix = ""
        if self.policy is not None:
            suffix = "+2bp" if self.policy == "paper" else f"+2bp:{self.policy}"
        if self.recompute is not None:
            suffix += f"+rc:{self.recompute}"
        if self.microbatches is not None:
            suffix += f" m={self.microbatches}"
        return f"{self.framework} {self.schedule}{suffix}"

    @property
    def is_pipeline(self) -> bool:
        """True for twobp, baseline, torch and DeepSpeed variants (False for references)."""
        return self.framework != REFERENCE

    @property
    def fused(self) -> Variant:
        """The same schedule of the same framework and recompute mode with the fused
        backward (without 2BP)."""
        return Variant(self.framework, self.schedule, recompute=self.recompute)


def twobp_variants(
    schedules: Sequence[str],
    policies: Sequence[str],
    without_2bp: bool,
    recomputes: Sequence[str | None] = (None,),
) -> list[Variant]:
    """The twobp variants: each fused schedule without 2BP and with each policy,
    each with every recompute mode.

    Natively split schedules (``zb-*``) run only as they are: their ``I`` and
    ``W`` are the schedule; merged into ``B`` they would be another schedule.
    """
    out: list[Variant] = []
    for name in schedules:
        if name in (AUTO, AUTO_MICROBATCHES):  # it chooses its own policy; no recomputation
            out.append(Variant(TWOBP, name))
            continue
        for mode in recomputes:
            if SCHEDULES[name].natively_split:
                out.append(Variant(TWOBP, name, two_bp=True, recompute=mode))
                continue
            if without_2bp:
                out.append(Variant(TWOBP, name, two_bp=False, recompute=mode))
            out.extend(
                Variant(TWOBP, name, two_bp=True, policy=p, recompute=mode) for p in policies
            )
    return out


def build_variants(
    schedules: Sequence[str],
    torch_schedules: Sequence[str],
    policies: Sequence[str],
    *,
    without_2bp: bool = True,
    references: Sequence[str] = REFERENCES,
    baseline: bool = False,
    recomputes: Sequence[str | None] = (None,),
    deepspeed_schedules: Sequence[str] = (),
) -> list[Variant]:
    """Every variant of one group, in run order.

    Each twobp schedule's variants come with their baseline copies (if
    ``baseline``) and the torch and DeepSpeed schedules of the same order
    (:data:`SAME_SCHEDULE`), then the other torch and DeepSpeed schedules, then
    the references.

    Raises:
        ValueError: on an unknown reference name.
    """
    unknown = [r for r in references if r not in REFERENCES]
    if unknown:
        raise ValueError(f"unknown reference(s) {unknown}; choose from {', '.join(REFERENCES)}")
    ours = twobp_variants(schedules, policies, without_2bp, recomputes)
    theirs = [Variant(TORCH, name, two_bp="ZeroBubble" in name) for name in torch_schedules]
    theirs += [Variant(DEEPSPEED, name) for name in deepspeed_schedules]
    # Variants compared with each other run next to each other: a burst of load
    # from another process then touches both sides of a comparison alike.
    out: list[Variant] = []
    for name in dict.fromkeys(v.schedule for v in ours):
        out.extend(v for v in ours if v.schedule == name)
        if baseline:
            out.extend(
                replace(v, framework=BASELINE)
                for v in ours
                if v.schedule == name and v.recompute is None and not is_auto(v)
            )
        out.extend(v for v in theirs if v.schedule == SAME_SCHEDULE.get(name))
    out.extend(v for v in theirs if v not in out)
    out.extend(
        Variant(REFERENCE, name, two_bp=name == REFERENCE_TWO_BP_LIMIT)
        for name in REFERENCES
        if name in references
    )
    return out


def counts_beside_auto(
    variants: Sequence[Variant], batch_size: int, n_ranks: int, m: int
) -> list[Variant]:
    """Torch's variants again at each other micro-batch count ``auto-m`` chooses among
    for this batch (:func:`twobp.sim.search.microbatch_counts`), where ``auto-m`` runs:
    its best count is then compared with torch's best count, not with torch at ``m``
    (counts torch refuses, DualPipeV's below ``2p``, left out)."""
    if not any(v.framework == TWOBP and v.schedule == AUTO_MICROBATCHES for v in variants):
        return []
    counts = [k for k in microbatch_counts(batch_size, n_ranks) if k != m]
    return [
        replace(v, microbatches=k)
        for v in variants
        if v.framework == TORCH and v.microbatches is None
        for k in counts
        if not torch_cannot_run(v, n_ranks, k)
    ]


def is_auto(variant: Variant) -> bool:
    """Whether twobp chooses the variant's schedule (``schedule="auto"``)."""
    return variant.framework in PIPELINES_OF_TWOBP and variant.schedule in (
        AUTO,
        AUTO_MICROBATCHES,
    )


def _twobp_schedule(variant: Variant, n_ranks: int) -> Schedule:
    """The twobp schedule of a variant for ``n_ranks`` (its layout does not depend on ``m``).

    Raises:
        ValueError: if the schedule does not exist for ``n_ranks``.
    """
    return generate(variant.schedule, n_ranks, 2 * n_ranks)


def placement(variant: Variant, n_ranks: int) -> tuple[int, ...]:
    """The rank of each stage (empty for ``auto``: it chooses when it is built).

    Raises:
        ValueError: if the twobp schedule does not exist for ``n_ranks``.
    """
    if is_auto(variant):
        return ()
    if variant.framework in PIPELINES_OF_TWOBP:
        return _twobp_schedule(variant, n_ranks).placement
    if variant.framework == REFERENCE:
        return (0,)
    if variant.framework == DEEPSPEED:
        return tuple(range(n_ranks))
    info = TORCH_SCHEDULES[variant.schedule]
    n_stages = n_ranks * info.stages_per_rank
    if info.placement == "v":
        return tuple(s if s < n_ranks else n_stages - 1 - s for s in range(n_stages))
    return tuple(s % n_ranks for s in range(n_stages))


def model_stages(variant: Variant, n_ranks: int) -> int:
    """Stages the model is cut into: those of one pipeline (Chimera runs two over them);
    0 for ``auto`` until it has chosen."""
    if is_auto(variant):
        return 0
    if variant.framework in PIPELINES_OF_TWOBP:
        return _twobp_schedule(variant, n_ranks).pipeline_stages
    return len(placement(variant, n_ranks))


def stages_of_rank(stage_ranks: Sequence[int], rank: int) -> list[int]:
    """The stages ``rank`` holds, in increasing order."""
    return [s for s, r in enumerate(stage_ranks) if r == rank]


def torch_cannot_run(variant: Variant, n_ranks: int, n_microbatches: int) -> bool:
    """True where torch refuses the variant for its micro-batch count: DualPipeV takes at
    least as many micro-batches as its ``2p`` stages (pure)."""
    return (
        variant.framework == TORCH
        and variant.schedule == "DualPipeV"
        and n_microbatches < model_stages(variant, n_ranks)
    )


def twobp_refusal(variant: Variant, n_ranks: int, n_microbatches: int) -> str | None:
    """Why twobp cannot build this schedule for ``p`` ranks and ``m`` micro-batches (or None)."""
    if variant.framework not in PIPELINES_OF_TWOBP or is_auto(variant):
        return None
    try:
        generate(variant.schedule, n_ranks, n_microbatches)
    except ValueError as exc:
        return str(exc)
    return None


def variant_partition(
    block_kinds: Sequence[str], n_stages: int, given: Sequence[int] | None
) -> tuple[int, ...]:
    """``given`` (``--partition``) where it has ``n_stages`` stages, else
    :func:`stage_partition`.

    Raises:
        ValueError: if ``given`` has that many stages but not that many blocks.
    """
    if given is None or len(given) != n_stages:
        return stage_partition(block_kinds, n_stages)
    if sum(given) != len(block_kinds):
        raise ValueError(
            f"--partition {','.join(map(str, given))} holds {sum(given)} blocks; the model "
            f"has {len(block_kinds)} ({', '.join(block_kinds)}): give counts that sum to it"
        )
    return tuple(given)


def stage_partition(block_kinds: Sequence[str], n_stages: int) -> tuple[int, ...]:
    """Blocks per stage: the body blocks split evenly, the ends with the first and last stage.

    The embedding (or stem) joins the first stage and the head the last, as
    in Megatron; with a looped or V placement the ranks then hold equal body
    work. When the body has fewer blocks than there are stages, the blocks are
    split as evenly as :func:`twobp.partition.uniform` does.

    Args:
        block_kinds: the role of each block: ``"embedding"``, ``"body"`` or ``"head"``.
        n_stages: number of stages.

    Returns:
        Block counts per stage.

    Raises:
        ValueError: if there are fewer blocks than stages.
    """
    n_blocks = len(block_kinds)
    body = sum(k == "body" for k in block_kinds)
    if body < n_stages or n_stages == 1:
        return tuple(uniform(n_blocks, n_stages))
    counts = uniform(body, n_stages)
    leading = next(i for i, k in enumerate(block_kinds) if k == "body")
    counts[0] += leading
    counts[-1] += n_blocks - leading - body
    return tuple(counts)


def round_robin(n_variants: int, rounds: int) -> list[tuple[int, int]]:
    """The order of ``(round, variant)`` runs: every variant once per round, in turn.

    ``round_robin(2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]``: A B A B.
    """
    return [(r, v) for r in range(rounds) for v in range(n_variants)]
