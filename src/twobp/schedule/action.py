"""The action: one unit of pipeline work, and its canonical text form.

An action names a stage, a kind and the micro-batch(es) it works on. Its text
form follows ``torch.distributed.pipelining`` where the notion is the same
(``1F0``, ``0I3``, ``2B1``, ``0SEND_F2``), and extends it for a backward-p2
over several micro-batches at once (a concatenated W):

    ``2W0-3``      stage 2, W of micro-batches 0, 1, 2, 3
    ``2W0-1+4``    stage 2, W of micro-batches 0, 1, 4

This module imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from twobp.schedule.kinds import (
    KINDS,
    ActionKind,
    DeclaredKind,
    Kind,
    held_change,
    kind_spec,
    pool_change,
)

__all__ = ["Action", "Kind", "format_microbatches", "parse_microbatches"]


@dataclass(frozen=True)
class Action:
    """One unit of work of one stage.

    Args:
        stage: the stage index (0 is the first stage of the model).
        kind: what the action does: a built-in :class:`Kind`, or a kind of
            :func:`twobp.schedule.declare_kind`.
        microbatches: the micro-batch indices it covers, sorted, without
            repeats. Only ``W`` (a kind whose table entry allows
            ``several``) may cover more than one.

    Raises:
        ValueError: on a negative index, an empty or unsorted micro-batch
            tuple, or several micro-batches for a kind other than ``W``.
    """

    stage: int
    kind: ActionKind
    microbatches: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"action stage must be >= 0, got {self.stage}")
        if not self.microbatches:
            raise ValueError(f"action {self.stage}{self.kind} has no micro-batch")
        if any(m < 0 for m in self.microbatches):
            raise ValueError(f"micro-batch indices must be >= 0, got {self.microbatches}")
        if list(self.microbatches) != sorted(set(self.microbatches)):
            raise ValueError(
                f"micro-batches of an action must be sorted and distinct, got {self.microbatches}"
            )
        if len(self.microbatches) > 1 and not kind_spec(self.kind).several:
            several = ", ".join(code for code, spec in KINDS.items() if spec.several)
            raise ValueError(
                f"only {several} may cover several micro-batches; "
                f"{self.kind.value} got {self.microbatches}"
            )

    @classmethod
    def make(cls, stage: int, kind: ActionKind | str, microbatches: int | Iterable[int]) -> Action:
        """Build an action from loose arguments (a kind or a built-in kind's code, an int
        or any iterable of ints)."""
        mbs = (microbatches,) if isinstance(microbatches, int) else tuple(sorted(microbatches))
        return cls(stage, kind if isinstance(kind, DeclaredKind) else Kind(kind), mbs)

    @property
    def microbatch(self) -> int:
        """The single micro-batch of this action.

        Raises:
            ValueError: if the action covers several micro-batches.
        """
        if len(self.microbatches) != 1:
            raise ValueError(f"{self} covers several micro-batches")
        return self.microbatches[0]

    def held_change(self, pool: str | None = None) -> int:
        """How many more micro-batches its rank holds once this action has run.

        Read from the memory entries of the kind table, for every micro-batch
        covered: those held in ``pool`` (one of
        :data:`twobp.schedule.kinds.MEMORY_POOLS`), or in any pool
        (``F`` +1, ``I`` 0, ``W`` and ``B`` -1 each).
        """
        per = held_change(self.kind) if pool is None else pool_change(self.kind, pool)
        return per * len(self.microbatches)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{format_microbatches(self.microbatches)}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str, kinds: Iterable[DeclaredKind] = ()) -> Action:
        """Parse the canonical text form, the inverse of ``str(action)``.

        Args:
            text: the action's text (``1F0``, ``2W0-3``).
            kinds: declared kinds (:func:`twobp.schedule.declare_kind`) the
                text may use besides the built-in ones.

        Raises:
            ValueError: if the text is not an action, or two of ``kinds`` share a code.
        """
        declared: dict[str, DeclaredKind] = {}
        for each in kinds:
            if declared.setdefault(each.value, each) != each:
                raise ValueError(f"two declared kinds have the code {each.value!r}; keep one")
        codes = [*KINDS, *declared]
        match = re.match(rf"^(\d+)({'|'.join(codes)})([0-9+\-]+)$", text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected [stage][kind][micro-batches], "
                f"e.g. '1F0', '0I3', '2W0-3'; kinds are {', '.join(codes)}"
            )
        stage, code, mbs = match.groups()
        kind: ActionKind = Kind(code) if code in KINDS else declared[code]
        return cls(int(stage), kind, parse_microbatches(mbs))


def format_microbatches(microbatches: tuple[int, ...]) -> str:
    """Write sorted micro-batch indices as ranges joined by ``+`` (``0-3+6``)."""
    parts: list[str] = []
    start = prev = microbatches[0]
    for m in microbatches[1:]:
        if m == prev + 1:
            prev = m
            continue
        parts.append(_span(start, prev))
        start = prev = m
    parts.append(_span(start, prev))
    return "+".join(parts)


def _span(start: int, end: int) -> str:
    return str(start) if start == end else f"{start}-{end}"


def parse_microbatches(text: str) -> tuple[int, ...]:
    """Inverse of :func:`format_microbatches`.

    Raises:
        ValueError: on an empty part, a reversed range or repeats.
    """
    out: list[int] = []
    for part in text.split("+"):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad micro-batch list {text!r}: expected e.g. '3', '0-3', '0-1+4'")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad micro-batch range {part!r} in {text!r}: end before start")
        out.extend(range(a, b + 1))
    if out != sorted(set(out)):
        raise ValueError(f"micro-batches in {text!r} must be increasing and distinct")
    return tuple(out)
