"""Which parameters several ranks hold, and over which ranks their gradients are reduced.

A parameter is held by several ranks when its stage is replicated (data
parallel, Chimera's two pipelines) or when blocks of different stages use the
same ``nn.Parameter`` object (a tied embedding and output head). Every holder
computes a part of its gradient; the ``R`` action of the schedule sums the
parts over exactly the ranks that hold it (:class:`ReductionPlan`).

The plan is pure: it reads the model's blocks, the stages' block ranges and
the topology, before the other ranks' blocks are dropped. Every rank builds
the same list of groups in the same order, so the process groups match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from twobp.runtime.base.topology import Topology
from twobp.schedule.schedule import Schedule


@dataclass(frozen=True)
class SharedParameter:
    """An ``nn.Parameter`` used by blocks of several stages of the model.

    Args:
        names: every name it has in ``nn.Sequential(*blocks)``, in model
            order; the first is the one it is saved and listed under.
        model_stages: the model stages whose blocks use it.
    """

    names: tuple[str, ...]
    model_stages: tuple[int, ...]

    @property
    def name(self) -> str:
        """The name it is saved and listed under (its first)."""
        return self.names[0]


def shared_parameters(
    blocks: Sequence[nn.Module], ranges: Sequence[range]
) -> dict[int, SharedParameter]:
    """The parameters used by blocks of more than one model stage, by ``id``.

    Args:
        blocks: the whole model's blocks.
        ranges: the block indices of each model stage.
    """
    names: dict[int, list[str]] = {}
    stages: dict[int, set[int]] = {}
    for stage, blocks_of_stage in enumerate(ranges):
        for i in blocks_of_stage:
            for name, p in blocks[i].named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(f"{i}.{name}")
                stages.setdefault(id(p), set()).add(stage)
    return {
        key: SharedParameter(tuple(names[key]), tuple(sorted(stages[key])))
        for key in names
        if len(stages[key]) > 1
    }


def tied_across_blocks(blocks: Sequence[nn.Module]) -> bool:
    """True if some parameter is used by more than one block (a tied embedding and head).

    Known before the model is cut into stages: the preparation pass places
    reductions for such a model (:func:`twobp.schedule.prepare.reduces`); where
    the blocks of a tie end up on one rank, its ``R`` has nothing to reduce.
    """
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            if owner.setdefault(id(p), i) != i:
                return True
    return False


@dataclass(frozen=True)
class ReductionGroup:
    """Parameters whose gradients are summed over one set of ranks.

    Args:
        key: what it reduces: ``"stage <k>"`` (the parameters of model stage
            ``k`` that no other stage uses) or ``"tied <name>"``.
        ranks: the group ranks that hold them, sorted.
        model_stages: the model stages whose parameters it holds.
    """

    key: str
    ranks: tuple[int, ...]
    model_stages: tuple[int, ...]


def reduction_groups(
    schedule: Schedule, topology: Topology, shared: dict[int, SharedParameter]
) -> list[ReductionGroup]:
    """Every reduction over more than one rank, in the same order on every rank.

    Args:
        schedule: the schedule (its stages and pipelines).
        topology: which ranks hold each stage.
        shared: the parameters used by several model stages.
    """

    def holders(model_stage: int) -> set[int]:
        return {
            rank for stage in schedule.replicas_of(model_stage) for rank in topology.replicas(stage)
        }

    groups = [
        ReductionGroup(f"stage {k}", tuple(sorted(holders(k))), (k,))
        for k in range(schedule.pipeline_stages)
    ]
    for tie in sorted(shared.values(), key=lambda t: t.name):
        ranks = set().union(*(holders(k) for k in tie.model_stages))
        groups.append(ReductionGroup(f"tied {tie.name}", tuple(sorted(ranks)), tie.model_stages))
    return [g for g in groups if len(g.ranks) > 1]


def local_aliases(
    shared: dict[int, SharedParameter], local_blocks: Sequence[int], blocks: Sequence[nn.Module]
) -> dict[str, tuple[str, ...]]:
    """For each shared parameter held here: its name, and the names it has in this rank's blocks.

    A rank that holds only the output head of a tied pair lists the weight
    under the embedding's name (its first), and a state dict stores it once.

    Returns:
        ``{first name: (local names...)}`` for the shared parameters this rank holds.
    """
    here = {str(i) for i in local_blocks}
    out: dict[str, tuple[str, ...]] = {}
    for tie in shared.values():
        names = tuple(n for n in tie.names if n.split(".", 1)[0] in here)
        if names:
            out[tie.name] = names
    return out
