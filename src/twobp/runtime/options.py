"""The options of a pipeline, typed, one docstring per field.

``Pipeline(blocks, loss_fn, **options)`` takes exactly the fields of
:class:`PipelineOptions`, by the same names, and keeps them as
``pipe.options``. ``twobp train``'s options that set the same thing take
their help from here (:func:`option_help`), and the trial pipelines of
``schedule="auto"`` are built from ``replace(pipe.options, ...)``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from twobp.runtime.execution.microbatch import Batch
from twobp.runtime.setup.auto.plan import CONTENDERS
from twobp.runtime.setup.pipeline_plan import CostsArgument
from twobp.runtime.state.grad_scaler import GradScaler
from twobp.schedule.schedule import Schedule


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class PipelineOptions:
    """Everything a pipeline is built with besides its blocks and loss."""

    schedule: str | os.PathLike[str] | Schedule = field(
        default="1f1b",
        metadata=_help(
            "a name of twobp.schedule.SCHEDULES, a Schedule, the path of a CSV file, or 'auto': "
            "profile the blocks on example_input (or plan on costs; without either, on the first "
            "step's first micro-batch), simulate every schedule, 2BP policy, W group cap and "
            "stages per rank, and run the fastest that fits memory_limit"
        ),
    )
    n_microbatches: int | str | None = field(
        default=None,
        metadata=_help(
            "micro-batches per step; None takes a Schedule's or CSV's own count, and 8 for a "
            "name; 'auto' (with schedule='auto'): chosen with the schedule for the first step's "
            "batch (the gradient is the same for every count)"
        ),
    )
    two_bp: bool | Sequence[bool] | None = field(
        default=None,
        metadata=_help(
            "split each backward into I and W (placing W by two_bp_policy); False runs fused B "
            "(split schedules are merged); one bool per stage of the model splits those stages "
            "only (not with schedule='auto', costs='profile' or recompute='auto'); None: where "
            "a profile says 2BP pays (a schedule by name with example_input: "
            "rank 0 profiles the blocks and simulates each stage split or fused), else True"
        ),
    )
    partition: Sequence[int] | str | None = field(
        default=None,
        metadata=_help(
            "blocks per stage (one int per stage), 'uniform', 'balanced' (profiled on "
            "example_input) or None: uniform, except for a V-shaped schedule (zb-v, dualpipev: "
            "rank 0 holds the first stage and the last), balanced where example_input is given"
        ),
    )
    two_bp_policy: str = field(
        default="paper",
        metadata=_help("where W goes: 'paper', 'eager' or 'fill' (see apply_two_bp)"),
    )
    stages_per_rank: int | None = field(
        default=None,
        metadata=_help("stages per rank for a schedule name (None: what the schedule needs)"),
    )
    device: torch.device | str | None = field(
        default=None,
        metadata=_help(
            "this rank's device; None picks cuda:LOCAL_RANK if CUDA is available and the backend "
            "can use it (NCCL), else the CPU"
        ),
    )
    timeout: float = field(
        default=300.0, metadata=_help("seconds a rank waits on a peer before PeerTimeoutError")
    )
    weight_group_size: int | None = field(
        default=None,
        metadata=_help(
            "the most micro-batches the 2BP engine concatenates (and, recomputing derivatives, "
            "rebuilds) at once in one W; None: no cap"
        ),
    )
    group: dist.ProcessGroup | None = field(
        default=None,
        metadata=_help(
            "the process group; None uses the default group (initialised from torchrun's "
            "environment if needed), or a single process world"
        ),
    )
    num_threads: int | None = field(
        default=None,
        metadata=_help(
            "intra-op threads of this rank; None shares the cores between the ranks of this "
            "machine unless OMP_NUM_THREADS is set"
        ),
    )
    example_input: Batch | None = field(
        default=None,
        metadata=_help(
            "one micro-batch of model inputs, for partition='balanced', costs='profile' and "
            "schedule='auto' (rank 0 profiles the blocks on it)"
        ),
    )
    nonfinite: str = field(
        default="raise",
        metadata=_help(
            "when a step's mean loss is NaN or infinite: 'raise' NonFiniteLossError, or 'skip' "
            "the step; either way its gradients are dropped on every rank"
        ),
    )
    costs: CostsArgument = field(
        default=None,
        metadata=_help(
            "the cost model by which 'paper' and 'fill' place W (a twobp.sim.CostModel, a mapping "
            "{'F': t, 'I': t, 'W': t}, or a cost JSON file); 'profile': measure the blocks on "
            "example_input; with schedule='auto', a cost model to choose by instead of profiling"
        ),
    )
    autocast: torch.dtype | None = field(
        default=None,
        metadata=_help(
            "run every stage's forward and loss under torch.autocast with this dtype (float32 "
            "master weights; 2BP's I and W in autocast's dtypes); None: no autocast"
        ),
    )
    data_parallel: int | None = field(
        default=None,
        metadata=_help(
            "copies of the pipeline D on D x P ranks, each on its own part of the batch; each "
            "stage's gradients are all-reduced over its copies by the schedule's R; None: 1, or "
            "the mesh's"
        ),
    )
    mesh: Any = field(
        default=None,
        metadata=_help("a 2-D DeviceMesh with dims ('dp', 'pp') that lays out the copies instead"),
    )
    recompute: str | Sequence[str | None] | None = field(
        default=None,
        metadata=_help(
            "trade compute for memory: 'activations' (F again in I), 'derivatives' (F and I again "
            "in W), 'all', or one mode (or None) per stage of the model; 'auto' (with "
            "memory_limit): rebuild only the stashes that do not fit, chosen per stage and "
            "micro-batch (the schedule's IR and WR); None: keep everything"
        ),
    )
    memory_limit: float | str | None = field(
        default=None,
        metadata=_help(
            "with schedule='auto' (or recompute='auto'), the most bytes a rank may hold, a number "
            "or a size such as '2GiB'"
        ),
    )
    optimizer_state_bytes: float = field(
        default=0.0,
        metadata=_help(
            "with schedule='auto' and a memory_limit, the bytes of optimizer state each parameter "
            "adds, held all the time (AdamW in float32: 8; with float32 masters of half-precision "
            "parameters: 12); 0: not counted"
        ),
    )
    optimizer_sharded: bool = field(
        default=False,
        metadata=_help(
            "with schedule='auto', the optimizer will be pipe.shard_optimizer's: each rank that "
            "holds a stage counts its share of the stage's optimizer_state_bytes, R is timed as "
            "a reduce-scatter and the all-gather of the updated parameters is waited for block "
            "by block in the first F (as twobp plan --shard-optimizer simulates)"
        ),
    )
    retain_host_memory: bool = field(
        default=True,
        metadata=_help(
            "on a CPU device, make the process keep the memory it frees for its next steps "
            "(glibc's malloc) instead of faulting its pages in again every step"
        ),
    )
    compile: bool | dict[str, Any] = field(
        default=False,
        metadata=_help(
            "compile each block with torch.compile, cut at the calls that read parameters so that "
            "2BP still defers and concatenates their weight gradients (the regions between are "
            "compiled); True: inductor; a dict: torch.compile's keywords (backend, mode, "
            "dynamic, ...). Blocks compiled by the user keep 2BP without it"
        ),
    )
    auto_trials: int = field(
        default=CONTENDERS,
        metadata=_help(
            "with schedule='auto' on measured costs, how many of the fastest simulated schedules "
            "run a few trial steps before the fastest measured is kept; 0 or 1: the simulator's "
            "choice"
        ),
    )
    grad_scaler: GradScaler | None = field(
        default=None,
        metadata=_help(
            "a twobp.GradScaler for float16: every micro-batch's loss is multiplied by its scale "
            "before the backward, and its unscale_/step/update agree on overflows over every "
            "rank of the pipeline and its copies (skipped or stepped together); None: no scaling"
        ),
    )

    def keywords(self) -> dict[str, Any]:
        """The options as keyword arguments of ``Pipeline``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def option_help(name: str) -> str:
    """The documentation of option ``name`` of :class:`PipelineOptions`.

    Raises:
        KeyError: if there is no such option.
    """
    for f in dataclasses.fields(PipelineOptions):
        if f.name == name:
            return str(f.metadata["help"])
    raise KeyError(name)
