"""The distributed runtime with every point-to-point tag 0: matching by order only, as on NCCL.

NCCL ignores tags and matches the operations of a pair by their order; gloo
honours tags, so a runtime tested only on gloo could come to rely on them.
A pipeline built with ``order_only_matching=True`` sends every operation with
tag 0. One launch of 2 ranks runs a representative subset of the equality and
failure cases in that mode: every way that transfers of several kinds share a
pair of ranks (two stages per rank in a V and in a ring, two pipelines in
opposite directions, tuples of tensors, an uneven partition), and failures of
a V on the first step, before any layout crossed, and later ones; with the
reductions of ``R`` started after the step's transfers, as on NCCL
(``reduce_after_transfers=True``). A launch of 3 ranks checks that every rank
names its links as its neighbours do, and still belongs to as many groups as
the others afterwards. The whole suite runs in that mode with the variable
:data:`ORDER_ONLY_VARIABLE` set in the environment
(``TWOBP_ORDER_ONLY_MATCHING=1 make test``), which a pipeline reads once, when
it is built.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn

from runtime_models import build_blocks, loss_fn, make_batch, train_reference
from runtime_workers import Case, needed_batches, train_cases
from step_failure_workers import BATCH as FAILURE_BATCH
from step_failure_workers import failing_steps
from test_runtime_distributed import BATCH, N_MB, _check_case, _replicas
from test_runtime_step_failure import _check
from twobp.runtime import Pipeline, launch
from twobp.runtime.communication.channel import (
    ORDER_ONLY_VARIABLE,
    StepChannel,
    order_only_matching,
)
from twobp.runtime.communication.reduction import GradientReducer
from twobp.runtime.execution.step_run import StepRun
from twobp.schedule.transfers import Direction

TIMEOUT = 30.0

TWO_RANKS = [
    Case("transformer", "zb-v", True),
    Case("mlp", "zb-v", False, partition=(1, 4, 3, 2)),
    Case("transformer", "interleaved-1f1b", True, policy="eager"),
    Case("mlp", "dualpipev", True, policy="fill", placed=True, n_microbatches=2 * N_MB),
    Case("conv", "chimera", True),
    Case("mlp", "dualpipe", True, n_microbatches=2 * N_MB),
]
FAILURES_ZB_V = [("block", 0, True), ("block", 4, False), ("loss", 9, False)]


# Every tag 0, and R's reductions after the step's transfers, as on NCCL (chimera and
# dualpipe reduce).
AS_ON_NCCL = {"order_only_matching": True, "reduce_after_transfers": True}


@contextlib.contextmanager
def _noted_tags() -> Iterator[set[int]]:
    """The tags of every point-to-point operation that step channels post meanwhile."""
    tags: set[int] = set()
    originals = StepChannel._tag, StepChannel._meta_tag

    def noting(original: Any) -> Any:
        def tag(channel: StepChannel, *args: Any) -> int:
            value: int = original(channel, *args)
            tags.add(value)
            return value

        return tag

    StepChannel._tag, StepChannel._meta_tag = noting(originals[0]), noting(originals[1])
    try:
        yield tags
    finally:
        StepChannel._tag, StepChannel._meta_tag = originals


@contextlib.contextmanager
def _noted_order() -> Iterator[list[str]]:
    """What steps do meanwhile, in order: each step's start, the end of its transfers
    (``finish``) and each reduction it starts (``reduce``)."""
    events: list[str] = []
    originals = StepRun.run, StepChannel.finish, GradientReducer.start

    def noting(event: str, original: Any) -> Any:
        def call(self: Any, *args: Any) -> Any:
            events.append(event)
            return original(self, *args)

        return call

    StepRun.run = noting("step", originals[0])  # type: ignore[method-assign]
    StepChannel.finish = noting("finish", originals[1])  # type: ignore[method-assign]
    GradientReducer.start = noting("reduce", originals[2])  # type: ignore[method-assign]
    try:
        yield events
    finally:
        StepRun.run, StepChannel.finish, GradientReducer.start = originals  # type: ignore[method-assign]


def _reduced_after_transfers(events: list[str]) -> bool:
    """Whether steps reduced, and every reduction started after its step's transfers."""
    transfers_done = False
    for event in events:
        if event == "step":
            transfers_done = False
        elif event == "finish":
            transfers_done = True
        elif not transfers_done:
            return False
    return "reduce" in events


def _session(timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _noted_tags() as tags, _noted_order() as events:
        out["trained"] = train_cases(TWO_RANKS, N_MB, BATCH, timeout, **AS_ON_NCCL)
        out["failures"] = failing_steps(
            FAILURES_ZB_V, timeout, "zb-v", partition="uniform", **AS_ON_NCCL
        )
        out["posted at the start"] = _posted_at_the_start(timeout)
    out["order only"] = tags == {0}
    out["reduced after transfers"] = _reduced_after_transfers(events)
    out["tags by the environment"] = _tags_by_the_environment(timeout)
    return out


def _tags_by_the_environment(timeout: float) -> dict[str, set[int]]:
    """The tags of one step of a pipeline built with :data:`ORDER_ONLY_VARIABLE` set to 1,
    unset again before the step, and of one built without it."""
    pipes = {}
    for name, variable in (("built with it", "1"), ("built without it", None)):
        if variable is not None:
            os.environ[ORDER_ONLY_VARIABLE] = variable
        try:
            pipes[name] = Pipeline(
                build_blocks("mlp"), loss_fn("mlp"), "1f1b", N_MB, device="cpu", timeout=timeout
            )
        finally:
            os.environ.pop(ORDER_ONLY_VARIABLE, None)
    x, y = make_batch("mlp", 0, BATCH)
    out = {}
    for name, pipe in pipes.items():
        with _noted_tags() as tags:
            pipe.step(*needed_batches(pipe, x, y))
        out[name] = tags
    return out


def _posted_at_the_start(timeout: float) -> list[tuple[int, int, int]]:
    """Two zb-v steps: at each start, the receives posted, the activations that lead the
    peer's order, and how many of them come before this rank's first send to it."""
    seen = []
    original = StepChannel.post_ahead

    def observed(channel: StepChannel) -> None:
        original(channel)
        (peer,) = channel._peers.values()
        leading = next(
            (i for i, t in enumerate(peer.incoming) if t.direction is not Direction.ACTIVATION),
            len(peer.incoming),
        )
        before_a_send = next((i for i, op in enumerate(peer.ops) if op.is_send), len(peer.ops))
        seen.append((len(channel._posted), leading, before_a_send))

    StepChannel.post_ahead = observed  # type: ignore[method-assign]
    try:
        pipe = Pipeline(
            build_blocks("mlp"),
            loss_fn("mlp"),
            "zb-v",
            N_MB,
            device="cpu",
            timeout=timeout,
            **AS_ON_NCCL,
        )
        x, y = make_batch("mlp", 0, BATCH)
        for _ in range(2):
            pipe.step(*needed_batches(pipe, x, y))
    finally:
        StepChannel.post_ahead = original  # type: ignore[method-assign]
    return seen


THREE_RANKS = Case("transformer", "1f1b", True, partition=(3, 5, 2))


def _three_ranks(timeout: float) -> dict[str, Any]:
    """A 3-rank pipeline (its middle rank has two neighbours, the ends one), then a group
    of all three made with ``use_local_synchronization``, as checkpoint storage makes it."""
    trained = train_cases([THREE_RANKS], N_MB, BATCH, timeout, order_only_matching=True)
    out: dict[str, Any] = {"trained": trained}
    names = dist.distributed_c10d._world.pg_names
    out["links"] = sorted(
        (tuple(dist.get_process_group_ranks(g)), name)
        for g, name in names.items()
        if g is not dist.group.WORLD and len(dist.get_process_group_ranks(g)) == 2
    )
    out["groups"] = len(names)
    every = dist.new_group(
        [0, 1, 2], timeout=datetime.timedelta(seconds=timeout), use_local_synchronization=True
    )
    work = dist.barrier(group=every, async_op=True)
    work.wait(timeout=datetime.timedelta(seconds=timeout))
    out["local group"] = names[every]
    return out


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return launch(_session, 2, TIMEOUT, threads_per_rank=1, timeout=300)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return launch(_three_ranks, 3, TIMEOUT, threads_per_rank=1, timeout=300)


@pytest.fixture(scope="module")
def failure_reference() -> tuple[float, dict[str, Any]]:
    """The loss and gradients of one plain step of the failure cases' model."""
    model = nn.Sequential(*build_blocks("mlp"))
    x, y = make_batch("mlp", 0, FAILURE_BATCH)
    loss = loss_fn("mlp")(model(x), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", TWO_RANKS, ids=str)
def test_two_ranks_match_single_process_with_every_tag_zero(case, two_ranks):
    assert all(r["order only"] for r in two_ranks)
    assert all(r["reduced after transfers"] for r in two_ranks)
    reference = train_reference(case.model, case.n_microbatches or N_MB, BATCH, _replicas(case))
    _check_case(case, [r["trained"] for r in two_ranks], reference)


def test_failures_of_a_v_end_every_rank_with_every_tag_zero(two_ranks, failure_reference):
    failures = [r["failures"] for r in two_ranks]
    block, loss = "block failed on purpose", "it must return a scalar"
    _check(failures, "block 0 first", 0, "RuntimeError", block, failure_reference)
    _check(failures, "block 4 later", 1, "RuntimeError", block, failure_reference)
    _check(failures, "loss 9 later", 0, "ValueError", loss, failure_reference)


def test_three_ranks_match_single_process_with_every_tag_zero(three_ranks):
    reference = train_reference(THREE_RANKS.model, N_MB, BATCH)
    _check_case(THREE_RANKS, [r["trained"] for r in three_ranks], reference)


def test_every_rank_makes_its_links_under_the_names_its_neighbours_give_them(three_ranks):
    # One group per direction of each pair; the middle rank holds four, the ends two.
    assert [len(r["links"]) for r in three_ranks] == [2, 4, 2]
    for pair in [(0, 1), (1, 2)]:
        names = [[n for ranks, n in three_ranks[r]["links"] if ranks == pair] for r in pair]
        assert len(names[0]) == 2 and names[0] == names[1]  # the same names on both ranks
    # Every rank belongs to as many groups afterwards, so a later group made with
    # use_local_synchronization (named by its ranks and that count) has one name.
    assert len({r["groups"] for r in three_ranks}) == 1
    assert len({r["local group"] for r in three_ranks}) == 1


def test_every_activation_receive_is_posted_at_the_start_of_a_step(two_ranks):
    # The first step knows no layout yet. From the second on, each rank of the V has
    # posted every activation that leads its peer's order, where posting only up to its
    # next send to the peer would have posted fewer (none, on the rank that sends first).
    seconds = []
    for rank in two_ranks:
        first, second = rank["posted at the start"]
        assert first[0] == 0
        posted, leading, _ = second
        assert posted == leading > 0
        seconds.append(second)
    assert any(posted > before_a_send for posted, _, before_a_send in seconds)


def test_a_pipeline_reads_the_environment_once_when_it_is_built(two_ranks):
    for rank in two_ranks:
        tags = rank["tags by the environment"]
        assert tags["built with it"] == {0}
        assert len(tags["built without it"]) > 1


def test_the_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(ORDER_ONLY_VARIABLE, raising=False)
    assert not order_only_matching()
    assert order_only_matching(requested=True)
    monkeypatch.setenv(ORDER_ONLY_VARIABLE, "1")
    assert order_only_matching()
    monkeypatch.setenv(ORDER_ONLY_VARIABLE, "0")
    assert not order_only_matching()
