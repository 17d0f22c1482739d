"""DeepSpeed's ``PipelineEngine`` as a bench variant: another framework's pipeline.

An optional peer (``pip install 'twobp[bench]'``): where ``deepspeed`` does
not import, :func:`deepspeed_refusal` gives the reason and the bench skips the
variant. Each rank wraps its stage's blocks in one module (the stage's
``nn.Sequential``, as the torch variants do) and hands DeepSpeed a
``PipelineModule`` of one such module per stage with ``partition_method="uniform"``,
so that DeepSpeed's stage ``s`` holds exactly the blocks of the bench's
partition. One step is ``engine.train_batch(iter(micro_batches))``: DeepSpeed's
``TrainSchedule`` (1F1B, one stage per rank) over the same ``m`` micro-batches,
which it always ends with an optimizer step. Work is made equal to the other
variants':

* DeepSpeed divides each micro-batch's loss by its gradient accumulation steps
  (``m``) before the backward: the gradients of the mean loss, as twobp's;
* with one pipeline (no data parallelism) its gradient all-reduce over the
  data-parallel group of one rank would flatten, "reduce" and copy back every
  gradient; it is turned off (``pipeline_enable_backward_allreduce``), as the
  torch variants run with ``scale_grads=False``, and the gradients are the same;
* the optimizer step the engine runs is :class:`HeldGradientsSGD`: plain SGD
  (``p -= lr * grad`` over every parameter of the rank) at learning rate 0, so
  the weights stay as they were and every step computes the same gradients as
  the other variants do; the step includes this update and DeepSpeed's
  ``zero_grad``, which the other variants' steps do not (their step is the
  forward and backward only). The update's own time is measured and reported
  beside the step (``after_step()["update_s"]``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twobp.partition import stage_ranges
from twobp.runtime.execution.microbatch import Batch, split_batch
from twobp.runtime.execution.stage import LossFn
from twobp_bench.matrix import DEEPSPEED_SCHEDULES, Variant, placement, stages_of_rank
from twobp_bench.torch_pipelining import StageModule

NOT_INSTALLED = "deepspeed is not installed (pip install 'twobp[bench]' or pip install deepspeed)"


def deepspeed_refusal() -> str | None:
    """Why DeepSpeed cannot run here: it does not import (None if it does).

    Importing it also picks DeepSpeed's CPU accelerator on a machine without a
    GPU, unless ``DS_ACCELERATOR`` says otherwise.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except ModuleNotFoundError as exc:
        if (exc.name or "deepspeed").split(".")[0] == "deepspeed":
            return NOT_INSTALLED
        return f"deepspeed does not import: {type(exc).__name__}: {exc}"
    except Exception as exc:  # a broken install fails in many ways; skip with its message
        return f"deepspeed does not import: {type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def _refusals_as_value_errors() -> Iterator[None]:
    """DeepSpeed's refusals (assertions, NotImplementedError) as the ValueError that the
    bench skips a variant for."""
    try:
        yield
    except (AssertionError, NotImplementedError) as exc:
        raise ValueError(f"DeepSpeed refused: {type(exc).__name__}: {exc}") from exc


class HeldGradientsSGD(torch.optim.SGD):
    """SGD that keeps the gradients of its last step, and how long its update took.

    DeepSpeed drops every gradient (``param.grad = None``) right after the
    optimizer step, inside ``train_batch``; the bench reads them after the step
    for its gradient check. Holding the tensors (no copy) lets the runner put
    them back, where the other variants leave theirs.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.0) -> None:
        super().__init__(params, lr=lr)
        self.held: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.update_seconds = 0.0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        start = time.perf_counter()
        out = super().step(closure)
        self.update_seconds = time.perf_counter() - start
        params = [p for group in self.param_groups for p in group["params"]]
        self.held = [(p, p.grad) for p in params if p.grad is not None]
        return out


class DeepSpeedRunner:
    """DeepSpeed's ``PipelineEngine`` over this rank's stage.

    Args:
        variant: a DeepSpeed variant (its schedule names a :data:`DEEPSPEED_SCHEDULES` entry).
        blocks: a fresh copy of the whole model's blocks.
        loss_fn: the model's loss (a mean over a micro-batch).
        n_microbatches: micro-batches per step.
        partition: blocks per stage (one stage per rank).
        inputs: the whole batch of model inputs.
        targets: the whole batch of targets.
        rank: this rank.
        n_ranks: ranks in the group.
        device: this rank's device.

    Raises:
        ValueError: if the partition does not have one stage per rank.
    """

    collective = True

    def __init__(
        self,
        variant: Variant,
        blocks: Sequence[nn.Module],
        loss_fn: LossFn,
        n_microbatches: int,
        partition: Sequence[int],
        inputs: Batch,
        targets: Batch,
        *,
        rank: int,
        n_ranks: int,
        device: torch.device,
    ) -> None:
        import deepspeed
        from deepspeed.pipe import PipelineModule

        schedule = DEEPSPEED_SCHEDULES[variant.schedule]
        stage_ranks = placement(variant, n_ranks)
        n_stages = len(stage_ranks)
        if len(partition) != n_stages:
            raise ValueError(
                f"DeepSpeed's {schedule} has {n_stages} stages but the partition has "
                f"{len(partition)}"
            )
        ranges = stage_ranges(list(partition))
        (stage,) = stages_of_rank(stage_ranks, rank)
        # Every stage's module exists on every rank (DeepSpeed is handed them all and
        # keeps its own); only this rank's is moved to the device and trained.
        stage_modules = [StageModule([blocks[i] for i in r]) for r in ranges]
        self.module = stage_modules[stage]
        self._block_indices = list(ranges[stage])
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        microbatch_size = len(split_batch(targets, n_microbatches)[0])
        config = {
            "train_micro_batch_size_per_gpu": microbatch_size,
            "gradient_accumulation_steps": n_microbatches,
            "train_batch_size": microbatch_size * n_microbatches,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        # DeepSpeed prints its partition on rank 0 as it builds the module; it refuses
        # what it cannot run with assertions.
        with contextlib.redirect_stdout(io.StringIO()), _refusals_as_value_errors():
            # On the group the bench launched (DeepSpeed wraps it, once per process).
            deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
            pipe = PipelineModule(
                layers=stage_modules,
                num_stages=n_stages,
                loss_fn=loss_fn,
                partition_method="uniform",
            )
            self.optimizer = HeldGradientsSGD(self.module.parameters())
            self.engine, *_ = deepspeed.initialize(
                model=pipe, optimizer=self.optimizer, config=config
            )
        if self.engine.grid.data_parallel_size == 1:
            self.engine.pipeline_enable_backward_allreduce = False
        self._microbatches = list(
            zip(
                split_batch(inputs, n_microbatches),
                split_batch(targets, n_microbatches, "targets"),
                strict=True,
            )
        )
        self._device = device

    def step(self) -> None:
        self.engine.train_batch(iter(self._microbatches))
        for p, grad in self.optimizer.held:
            p.grad = grad
        self.optimizer.held = []

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Named by block index in the whole model, as twobp's pipeline names them."""
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for name, p in self.module.blocks.named_parameters():
            local, _, rest = name.partition(".")
            named.setdefault(id(p), (f"{self._block_indices[int(local)]}.{rest}", p))
        return list(named.values())

    def after_step(self) -> dict[str, float]:
        return {"update_s": self.optimizer.update_seconds}
