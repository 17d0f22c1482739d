"""A choice made on rank 0 and handed to every rank: the one driver of the planner's choices.

``schedule="auto"``, the profiled 2BP stages and ``recompute="auto"`` each measure
on rank 0, cost, choose there, and broadcast the choice; a failure on rank 0 is
raised on every rank, so none waits for a choice that never comes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from twobp.runtime.base.group import Membership
from twobp.runtime.errors import PipelineConfigError

T = TypeVar("T")


def decided_on_rank_0(
    world: Membership, choose: Callable[[], T], kind: type[T], failed: Callable[[Exception], str]
) -> T:
    """Rank 0's ``choose()``, on every rank. Collective.

    Args:
        world: the group.
        choose: what rank 0 runs (the others do not call it).
        kind: the type of a choice.
        failed: the message every rank raises when ``choose`` raised a
            ``ValueError`` or :class:`PipelineConfigError` on rank 0.

    Raises:
        PipelineConfigError: on every rank, with ``failed(error)``.
    """
    answer: list[object] = [None]
    if world.rank == 0:
        try:
            answer[0] = choose()
        except (ValueError, PipelineConfigError) as exc:
            answer[0] = failed(exc)
    if world.group is not None:
        dist.broadcast_object_list(answer, src=world.global_rank(0), group=world.group)
    choice = answer[0]
    if not isinstance(choice, kind):
        raise PipelineConfigError(str(choice))
    return choice
