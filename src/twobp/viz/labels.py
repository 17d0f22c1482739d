"""Short labels of actions shared by the renderers.

A label is kind and micro-batches (``F0``, ``I3``, ``W0-3``); the stage is
prefixed (``1F0``) only when some rank holds several stages, since with one
stage per rank the row already says which stage it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from twobp.schedule.action import Action, format_microbatches
from twobp.schedule.kinds import Role
from twobp.timeline import Span


def compute_spans(spans: Iterable[Span]) -> list[Span]:
    """The spans of compute and background kinds (F, B, I, W, R), in (rank, start)
    order; communication (sends and receives) is dropped."""
    return sorted((s for s in spans if s.action.kind.is_compute), key=lambda s: (s.rank, s.start))


def drawn_spans(spans: Iterable[Span]) -> list[Span]:
    """:func:`compute_spans` less the background kinds (the gradient reductions ``R``),
    which run under the compute they overlap and would hide it in a picture."""
    return [s for s in compute_spans(spans) if s.action.kind.role is not Role.BACKGROUND]


def several_stages_per_rank(spans: Sequence[Span]) -> bool:
    """True if some rank ran actions of more than one stage."""
    stages: dict[int, set[int]] = {}
    for s in spans:
        stages.setdefault(s.rank, set()).add(s.action.stage)
    return any(len(v) > 1 for v in stages.values())


def action_label(action: Action, with_stage: bool) -> str:
    """``F0``/``W0-3``, or ``1F0``/``1W0-3`` when ``with_stage``."""
    text = f"{action.kind.value}{format_microbatches(action.microbatches)}"
    return f"{action.stage}{text}" if with_stage else text
