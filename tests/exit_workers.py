"""Functions run on every rank by the tests of a rank's exit (``test_runtime_exit``)."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twobp.runtime import Pipeline, PipelineClosedError, PipelineConfigError
from twobp.runtime.communication.collective import complete, holders_of


def blocks() -> list[nn.Module]:
    """The model of the simplest use of the launcher: five blocks, one of them empty."""
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(8, 16), nn.Tanh()),
        nn.Linear(16, 16),
        nn.Sequential(nn.Linear(16, 16), nn.GELU()),
        nn.Identity(),
        nn.Linear(16, 1),
    ]


def one_step() -> int:
    """Build a pipeline, run one step, return: what a first script does."""
    pipe = Pipeline(blocks(), F.mse_loss, schedule="1f1b", n_microbatches=4)
    x = torch.randn(16, 8)
    pipe.step(x, x[:, :1])
    return 1


def steps_after_mistakes() -> int:
    """Three caught configuration errors, several pipelines, then steps that work."""
    rank = dist.get_rank()
    x = torch.randn(16, 8)
    pipe = Pipeline(blocks(), F.mse_loss, schedule="1f1b", n_microbatches=4)
    mistakes = [
        lambda: pipe.step(None if rank == 0 else x, x[:, :1]),  # rank 0 lacks the inputs
        lambda: pipe.step(x[:6], x[:6, :1]),  # 6 samples do not split into 4
        lambda: pipe.step(x, x[:8, :1]),  # inputs and targets differ in size
        lambda: Pipeline(blocks(), F.mse_loss, schedule="no-such-schedule"),
        lambda: Pipeline(blocks(), F.mse_loss, partition=[1, 1, 1]),
    ]
    for mistake in mistakes:
        with contextlib.suppress(PipelineConfigError):
            mistake()
    pipe.step(x, x[:, :1])
    other = Pipeline(blocks(), F.mse_loss, schedule="gpipe", n_microbatches=2)
    other.step(x, x[:, :1])
    return 1


def held_after_collectives(rounds: int, wait: bool) -> int:
    """How many of ``rounds`` all-reduces returned while gloo still held their tensor.

    ``wait``: through :func:`complete`, as every collective of twobp; otherwise
    plain torch, waited on and its handle dropped (what a script does).
    """
    tensor = torch.ones(1000)
    held = 0
    for _ in range(rounds):
        before = holders_of(tensor)
        post = lambda: dist.all_reduce(tensor, async_op=True)  # noqa: E731
        if wait:
            rank = dist.get_rank()
            complete(post, tensor, rank=rank, peer=None, where="", what="", timeout=60.0)
        else:
            work = post()
            work.wait()
            del work
        held += holders_of(tensor) > before
    return held


def _gloo_threads() -> int:
    """How many gloo worker threads this process runs, once the count is steady.

    A new thread takes its name a moment after it starts: count until two
    reads 50 ms apart agree.
    """
    last = _count_gloo_threads()
    for _ in range(40):
        time.sleep(0.05)
        now = _count_gloo_threads()
        if now == last:
            return now
        last = now
    return last


def _count_gloo_threads() -> int:
    """How many threads named as gloo worker threads this process runs now."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except OSError:
            pass
    return count


def group_threads_after_destroy(keep_pipeline: bool) -> dict[str, Any]:
    """Gloo threads of a group before and after it is destroyed, a pipeline having run in it.

    Nothing here calls the garbage collector: what keeps the group alive
    after ``destroy_process_group`` keeps its threads running into the
    interpreter's exit.
    """
    dist.barrier()  # the default group's own threads start on its first use
    before = _gloo_threads()
    group = dist.new_group(backend="gloo")
    pipe: Pipeline | None = Pipeline(
        blocks(), F.mse_loss, schedule="1f1b", n_microbatches=4, group=group
    )
    assert pipe is not None
    x = torch.randn(16, 8)
    pipe.step(x, x[:, :1])
    during = _gloo_threads()
    with contextlib.suppress(PipelineConfigError):
        pipe.step(None, None)  # a caught error: its traceback holds the step's frames
    if not keep_pipeline:
        pipe = None
    dist.destroy_process_group(group)
    del group
    out: dict[str, Any] = {"before": before, "during": during, "after": _gloo_threads()}
    if pipe is not None:
        try:
            pipe.step(x, x[:, :1])
        except PipelineClosedError as exc:
            out["error"] = str(exc)
    return out


def closed_pipeline() -> dict[str, str]:
    """What each call of a closed pipeline says."""
    x = torch.randn(16, 8)
    with Pipeline(blocks(), F.mse_loss, schedule="1f1b", n_microbatches=4) as pipe:
        pipe.step(x, x[:, :1])
    pipe.close()  # a second close does nothing
    calls = {
        "step": lambda: pipe.step(x, x[:, :1]),
        "eval_step": lambda: pipe.eval_step(x),
        "timeline": pipe.timeline,
        "save": lambda: pipe.save("unused"),
        "clip_grad_norm_": lambda: pipe.clip_grad_norm_(1.0),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
        except PipelineClosedError as exc:
            out[name] = str(exc)
    return out
