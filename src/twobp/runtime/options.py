"""The options of a pipeline, typed, one docstring per field: the runtime's vocabulary.

``Pipeline(blocks, loss_fn, **options)`` takes the fields of
:class:`PipelineOptions` by the same names (or ``options=PipelineOptions(...)``)
and keeps them as ``pipe.options``; the live resources a pipeline is built on
(``group``, ``mesh``, ``device``, ``example_input``, ``grad_scaler``) are
arguments of their own, not options. ``twobp train`` builds its options in one
function from its config and takes its help from here (:func:`option_help`);
the planner takes them whole, and the trial pipelines of ``schedule="auto"``
are built from ``replace(pipe.options, ...)``.

This module is the bottom floor of :mod:`twobp.runtime` (with its errors): it
holds the value types and markers the options need and the checks that need
nothing but the options, so every layer of the runtime can take them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import Tensor

from twobp.runtime.errors import PipelineConfigError
from twobp.schedule import SCHEDULES
from twobp.schedule._timing import Costs
from twobp.schedule.prepare import ScheduleConfigError, split_per_stage
from twobp.schedule.schedule import Schedule
from twobp.sim.recompute import RECOMPUTE_AUTO, parse_recompute

Batch: TypeAlias = Tensor | tuple[Tensor, ...]
"""One tensor or a tuple of tensors, all with the samples along dim 0."""

CostsArgument = Costs | str | os.PathLike[str]
"""What ``Pipeline(costs=...)`` takes: a cost model, a mapping, a cost JSON file, or
``"profile"`` (measure the blocks and place W by their costs)."""

AUTO = "auto"
"""The schedule name that asks the pipeline to choose."""
AUTO_MICROBATCHES = "auto"
"""``n_microbatches=`` that has ``schedule="auto"`` choose the count for the first step's batch."""
PROFILE = "profile"
"""``costs=`` that measures the blocks on ``example_input`` (as ``schedule="auto"`` does)."""
NONFINITE_POLICIES = ("raise", "skip")
"""What a pipeline does when a step's mean loss is NaN or infinite."""
CONTENDERS = 6
"""Schedules ``schedule="auto"`` runs for a few trial steps before it settles (``auto_trials``)."""

RESOURCES = ("group", "mesh", "device", "example_input", "grad_scaler")
"""What ``Pipeline`` is built on besides its options: live objects, not kept as options."""


def _help(text: str, cli: str = "", details: str = "") -> dict[str, str]:
    """A field's documentation: its help, the ``twobp train`` option that sets it (if
    any) and a link to more (relative to the repository's root), both for the README."""
    return {"help": text, "cli": cli, "details": details}


@dataclass(frozen=True)
class PipelineOptions:
    """Everything a pipeline is built with besides its blocks and loss."""

    schedule: str | os.PathLike[str] | Schedule = field(
        default="1f1b",
        metadata=_help(
            "a name of twobp.schedule.SCHEDULES (naive, gpipe, 1f1b, interleaved-1f1b, zb-h1, "
            "zb-h2, zb-v, dualpipev, chimera, dualpipe), a Schedule, the path of a CSV file, or "
            "'auto': "
            "profile the blocks on example_input (or plan on costs; without either, on the first "
            "step's first micro-batch), simulate every schedule, 2BP policy, W group cap and "
            "stages per rank, and run the fastest that fits memory_limit",
            cli="--schedule",
            details="docs/schedules.md#letting-twobp-choose-scheduleauto",
        ),
    )
    n_microbatches: int | str | None = field(
        default=None,
        metadata=_help(
            "micro-batches per step; None takes a Schedule's or CSV's own count, and 8 for a "
            "name; 'auto' (with schedule='auto'): chosen with the schedule for the first step's "
            "batch (the gradient is the same for every count)",
            cli="--microbatches",
        ),
    )
    two_bp: bool | Sequence[bool] | None = field(
        default=None,
        metadata=_help(
            "split each backward into I and W (placing W by two_bp_policy); False runs fused B "
            "(split schedules are merged); one bool per stage of the model splits those stages "
            "only (not with schedule='auto', costs='profile' or recompute='auto'); None: where "
            "a profile says 2BP pays (a schedule by name with example_input: "
            "rank 0 profiles the blocks and simulates each stage split or fused), else True",
            cli="--two-bp / --no-two-bp",
            details="docs/user-guide.md#use-it-from-python",
        ),
    )
    partition: Sequence[int] | str | None = field(
        default=None,
        metadata=_help(
            "blocks per stage (one int per stage), 'uniform', 'balanced' (profiled on "
            "example_input) or None: uniform, except for a schedule whose rank 0 holds the "
            "first stage and the last (zb-v, dualpipev on 2 ranks or more; chimera, dualpipe "
            "on more than 2): balanced on example_input, or without one on the first step's "
            "first micro-batch "
            "(pipe.partition_by says how the blocks were cut)",
            cli="--partition",
        ),
    )
    two_bp_policy: str = field(
        default="paper",
        metadata=_help(
            "where W goes: 'paper', 'eager', 'fill' (placed before the step, see apply_two_bp) "
            "or 'dynamic': into the waits each rank meets as the step runs, one layer's W at "
            "a time; pipe.step_times counts them",
            cli="--policy",
            details="docs/schedules.md#w-at-run-time-policy-dynamic",
        ),
    )
    stages_per_rank: int | None = field(
        default=None,
        metadata=_help(
            "stages per rank for a schedule name (None: what the schedule needs)",
            cli="--stages-per-rank",
        ),
    )
    timeout: float = field(
        default=300.0,
        metadata=_help(
            "seconds a rank waits on a peer before PeerTimeoutError",
            cli="--timeout",
            details="docs/reliability.md",
        ),
    )
    weight_group_size: int | None = field(
        default=None,
        metadata=_help(
            "the most micro-batches the 2BP engine concatenates (and, recomputing derivatives, "
            "rebuilds) at once in one W; None: no cap",
            cli="--weight-group-size",
        ),
    )
    num_threads: int | None = field(
        default=None,
        metadata=_help(
            "intra-op threads of this rank; None shares the cores between the ranks of this "
            "machine unless OMP_NUM_THREADS is set",
            cli="--threads",
        ),
    )
    nonfinite: str = field(
        default="raise",
        metadata=_help(
            "when a step's mean loss is NaN or infinite: 'raise' NonFiniteLossError, or 'skip' "
            "the step; either way its gradients are dropped on every rank",
            cli="--nonfinite",
            details="docs/reliability.md",
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
            "master weights; 2BP's I and W in autocast's dtypes); None: no autocast",
            cli="--dtype bfloat16 --autocast",
        ),
    )
    data_parallel: int | None = field(
        default=None,
        metadata=_help(
            "copies of the pipeline D on D x P ranks, each on its own part of the batch; each "
            "stage's gradients are all-reduced over its copies by the schedule's R; None: 1, or "
            "the mesh's",
            cli="--data-parallel",
            details="docs/user-guide.md#replicated-stages-data-parallel-chimera-tied-weights",
        ),
    )
    shard_parameters: bool = field(
        default=False,
        metadata=_help(
            "shard each stage's parameters, gradients and optimizer state over the ranks that "
            "hold it, its data-parallel copies and Chimera's and DualPipe's two pipelines "
            "(ZeRO-3): a stage's weights are gathered before its first F of a step and "
            "freed after its last I, before its W; each stage's gradient is reduce-scattered at "
            "its R, or after each W (scatter_each_w); build the optimizer with "
            "pipe.shard_optimizer",
            cli="--shard-parameters",
            details="docs/user-guide.md#parameters-sharded-over-the-copies-zero-3",
        ),
    )
    scatter_each_w: bool | None = field(
        default=False,
        metadata=_help(
            "with shard_parameters=True, where a stage's whole gradients are reduce-scattered: "
            "False at its R (held from its first W to R); True after each of its W (and B), "
            "in the background (held only while a W and its reduce-scatter run; one "
            "reduce-scatter per W); None after each W only for the stages whose schedule holds "
            "their gradients across other work, where it can lower the peak",
            cli="--scatter-each-w",
            details="docs/user-guide.md#parameters-sharded-over-the-copies-zero-3",
        ),
    )
    tensor_parallel: int | Sequence[int] | None = field(
        default=None,
        metadata=_help(
            "ranks T each block is split over (Megatron-style: column- and row-parallel "
            "linears) by tensor_parallel_plan, on D x P x T ranks laid out dp x pp x tp, tensor "
            "parallel innermost; a tuple of sizes (with schedule='auto'): the one whose "
            "simulated step is fastest, P = ranks / (D x T); None: 1",
            cli="--tensor-parallel",
            details="docs/user-guide.md#tensor-parallelism-in-a-pipeline",
        ),
    )
    tensor_parallel_plan: Any = field(
        default=None,
        metadata=_help(
            "with tensor_parallel: module-name pattern (fnmatch, e.g. 'attn.wq', 'mlp.*') -> "
            "'colwise' or 'rowwise' ('rowwise' on an nn.Embedding splits its vocabulary; "
            "'colwise_gather_output' for a head, 'colwise_loss_parallel' for a head whose "
            "logits stay split for the loss's F.cross_entropy), applied to each block whose "
            "modules it "
            "names (a head tied to a split embedding follows it), or a "
            "callable (block_index, block) -> such a mapping (twobp.models."
            "tensor_parallel_plan(name), twobp.integrations.transformers.tensor_parallel_plan)",
            details="docs/user-guide.md#tensor-parallelism-in-a-pipeline",
        ),
    )
    recompute: str | Sequence[str | None] | None = field(
        default=None,
        metadata=_help(
            "trade compute for memory: 'activations' (F again in I), 'derivatives' (F and I again "
            "in W), 'all', or one mode (or None) per stage of the model; 'auto' (with "
            "memory_limit): the run as without it (schedule, 2BP stages, partition) where the "
            "simulator predicts it fits, else only the stashes that do not fit are rebuilt, "
            "chosen per stage and micro-batch (the schedule's IR and WR); None: keep everything",
            cli="--recompute",
            details="README.md#memory",
        ),
    )
    memory_limit: float | str | None = field(
        default=None,
        metadata=_help(
            "with schedule='auto' (or recompute='auto'), the most bytes a rank may hold, a number "
            "or a size such as '2GiB'",
            cli="--memory-limit",
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
            "by block in the first F (as twobp plan --shard-optimizer simulates)",
            cli="--shard-optimizer",
            details="docs/user-guide.md#the-optimizer-state-sharded-over-the-copies-zero-1",
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
            "dynamic, ...). Blocks compiled by the user keep 2BP without it",
            cli="--compile",
            details="docs/engine.md#compiled-modules-torchcompile",
        ),
    )
    auto_trials: int = field(
        default=CONTENDERS,
        metadata=_help(
            "with schedule='auto' on measured costs, how many of the fastest simulated schedules "
            "run a few trial steps before the fastest measured is kept; 0 or 1: the simulator's "
            "choice",
            cli="--auto-trials",
        ),
    )
    order_only_matching: bool = field(
        default=False,
        metadata=_help(
            "send every point-to-point operation with tag 0, so that gloo too matches them by "
            "their order only, as NCCL does (a check on CPU that nothing relies on tags); "
            "TWOBP_ORDER_ONLY_MATCHING=1 in the environment when the pipeline is built turns it "
            "on as well",
            details="docs/reliability.md",
        ),
    )
    reduce_after_transfers: bool = field(
        default=False,
        metadata=_help(
            "start the gradient reductions of R only once the step's point-to-point transfers "
            "are complete, as on NCCL (always so there), on any backend; "
            "TWOBP_REDUCE_AFTER_TRANSFERS=1 in the environment when the pipeline is built turns "
            "it on as well",
            details="docs/reliability.md",
        ),
    )

    def keywords(self) -> dict[str, Any]:
        """The options as keyword arguments of ``Pipeline``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def updated(self, keywords: dict[str, Any]) -> PipelineOptions:
        """These options with every keyword that is not its field's default taken instead.

        Raises:
            PipelineConfigError: naming a keyword that is not an option.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        unknown = sorted(set(keywords) - set(defaults))
        if unknown:
            raise PipelineConfigError(
                f"{', '.join(unknown)}: not an option of a pipeline (see PipelineOptions)"
            )
        changed = {k: v for k, v in keywords.items() if not _is_default(v, defaults[k])}
        return dataclasses.replace(self, **changed) if changed else self

    def check(self) -> None:
        """Refuse what no rank could run, at once, before any collective work (the
        planner refuses the rest on every rank, naming the rank: ``nonfinite``).

        Raises:
            PipelineConfigError: naming the option and what to give instead.
        """
        check_recompute(self.recompute, self.memory_limit)
        if not isinstance(self.tensor_parallel, int | None):
            check_sizes(self)
        elif self.tensor_parallel is not None and self.tensor_parallel != 1:
            check_size(self.tensor_parallel)
            if self.tensor_parallel_plan is None:
                raise PipelineConfigError(
                    f"tensor_parallel={self.tensor_parallel} needs tensor_parallel_plan: which "
                    "linears to split, e.g. twobp.models.tensor_parallel_plan('llama')"
                )
            refuse_planning_apart(self)
        check_two_bp(self.two_bp, self.schedule)
        check_scatter_each_w(self.scatter_each_w, self.shard_parameters)
        check_microbatches(self.schedule, self.n_microbatches, self.costs)
        schedule = self.schedule
        by_name = isinstance(schedule, str) and (schedule == AUTO or schedule in SCHEDULES)
        if self.rebuilds and not by_name:
            raise PipelineConfigError(
                f"recompute='auto' chooses the stashes to rebuild on a schedule it builds; "
                f"schedule={schedule!r} is given whole: use a name or 'auto', or mark the "
                "rebuilt micro-batches in the schedule yourself (IR and WR actions)"
            )
        if isinstance(self.costs, str) and self.costs == PROFILE and not by_name:
            raise PipelineConfigError(
                "costs='profile' places W by the measured costs of a schedule given by name; "
                f"{schedule!r} is not one: use a name, or schedule='auto'"
            )

    @property
    def rebuilds(self) -> bool:
        """True for ``recompute="auto"``: rebuild only the stashes that do not fit."""
        return rebuilds(self.recompute)


def options_table() -> str:
    """Every option as a Markdown table (option, ``twobp train`` option, default, what),
    from the fields' documentation: the README's table of options, rendered.

    ``twobp.runtime.options.render_readme(path)`` writes it into the README.
    """
    rows = ["| option | `twobp train` | default | what |", "|---|---|---|---|"]
    for f in dataclasses.fields(PipelineOptions):
        meta = f.metadata
        cli = " / ".join(f"`{c.strip()}`" for c in meta["cli"].split("/")) if meta["cli"] else ""
        what = meta["help"] + (f" ([details]({meta['details']}))" if meta["details"] else "")
        rows.append(f"| `{f.name}` | {cli} | `{f.default!r}` | {what} |")
    return "\n".join(rows) + "\n"


README_START = "<!-- options: rendered by twobp.runtime.options.render_readme; edit the fields -->"
README_END = "<!-- end of options -->"


def render_readme(path: str | os.PathLike[str]) -> None:
    """Write :func:`options_table` into the README at ``path``, between its markers."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    start = text.index(README_START) + len(README_START) + 1
    end = text.index(README_END)
    with open(path, "w", encoding="utf-8") as file:
        file.write(text[:start] + options_table() + text[end:])


def option_help(name: str) -> str:
    """The documentation of option ``name`` of :class:`PipelineOptions`.

    Raises:
        KeyError: if there is no such option.
    """
    for f in dataclasses.fields(PipelineOptions):
        if f.name == name:
            return str(f.metadata["help"])
    raise KeyError(name)


def _is_default(value: object, default: object) -> bool:
    try:
        return value is default or bool(value == default)
    except Exception:  # a tensor or another value without a plain ==
        return False


def rebuilds(recompute: object) -> bool:
    """True for ``recompute="auto"``: rebuild only the stashes that do not fit."""
    return isinstance(recompute, str) and recompute == RECOMPUTE_AUTO


def check_recompute(recompute: object, memory_limit: object) -> None:
    """Refuse an unknown recompute mode, or ``"auto"`` without a limit.

    Raises:
        PipelineConfigError: saying what to give instead.
    """
    if rebuilds(recompute):
        if memory_limit is None:
            raise PipelineConfigError(
                "recompute='auto' rebuilds only the stashes that do not fit memory_limit, "
                "and none was given: pass memory_limit= (bytes per rank, or a size such as "
                "'2GiB'), or choose a mode for every stage: 'activations', 'derivatives', 'all'"
            )
        return
    count = len(recompute) if isinstance(recompute, (list, tuple)) else 1
    try:
        parse_recompute(recompute, count)  # type: ignore[arg-type]
    except ValueError as error:
        raise PipelineConfigError(str(error)) from None


def check_scatter_each_w(scatter_each_w: object, shard_parameters: bool) -> None:
    """Refuse a ``scatter_each_w`` that is not True, False or None, or one given without
    ``shard_parameters=True``.

    Raises:
        PipelineConfigError: naming what to give.
    """
    if not (scatter_each_w is None or isinstance(scatter_each_w, bool)):
        raise PipelineConfigError(
            f"scatter_each_w={scatter_each_w!r}: give False (at each stage's R), True (after "
            "each W) or None (after each W where that can lower the peak)"
        )
    if scatter_each_w is not False and not shard_parameters:
        raise PipelineConfigError(
            f"scatter_each_w={scatter_each_w!r} says where sharded parameters' gradients are "
            "reduce-scattered: give shard_parameters=True with it, or leave it out"
        )


def check_two_bp(two_bp: object, schedule: object) -> None:
    """Refuse a ``two_bp`` that is neither a bool, None nor a list of bools,
    and one per stage with ``schedule="auto"``, which chooses 2BP itself.

    Raises:
        PipelineConfigError: saying what to give instead.
    """
    if two_bp is None or isinstance(two_bp, bool):
        return
    count = len(two_bp) if isinstance(two_bp, (list, tuple)) else 1
    try:
        split_per_stage(two_bp, count)  # type: ignore[arg-type]
    except ScheduleConfigError as error:
        raise PipelineConfigError(str(error)) from None
    if isinstance(schedule, str) and schedule == AUTO:
        raise PipelineConfigError(
            f"two_bp={two_bp!r} (one per stage) with schedule='auto', which chooses "
            "2BP and the stages itself: pass True, False or None, or name a schedule"
        )


def check_microbatches(schedule: object, n_microbatches: object, costs: object) -> None:
    """Refuse a micro-batch count that is neither a positive int, None nor ``"auto"``,
    and ``"auto"`` where nothing measures what the counts cost.

    Raises:
        PipelineConfigError: saying what to give instead.
    """
    if n_microbatches is None or (
        isinstance(n_microbatches, int) and not isinstance(n_microbatches, bool)
    ):
        return
    if n_microbatches != AUTO_MICROBATCHES:
        raise PipelineConfigError(
            f"n_microbatches={n_microbatches!r}: give a positive int, None (the schedule's "
            "own count) or 'auto' (with schedule='auto': chosen for the first step's batch)"
        )
    if not (isinstance(schedule, str) and schedule == AUTO):
        raise PipelineConfigError(
            f"n_microbatches='auto' is chosen by schedule='auto', not with schedule="
            f"{schedule if isinstance(schedule, str) else type(schedule).__name__!r}: use "
            "schedule='auto', or give a count"
        )
    if costs is not None:
        raise PipelineConfigError(
            "n_microbatches='auto' compares micro-batches of different sizes, which a given "
            "cost model does not price: drop costs= (the blocks are profiled on the first "
            "step's batch), or give a count"
        )


def check_size(tensor_parallel: object) -> None:
    """Refuse a ``tensor_parallel`` that is not a count of ranks.

    Raises:
        PipelineConfigError: naming the value.
    """
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise PipelineConfigError(
            f"tensor_parallel={tensor_parallel!r}: give the number of ranks each block is "
            "split over, an int >= 1"
        )


def check_sizes(options: PipelineOptions) -> None:
    """Refuse a range of ``tensor_parallel`` sizes that ``schedule="auto"`` cannot search.

    Raises:
        PipelineConfigError: naming what to give instead.
    """
    sizes = options.tensor_parallel
    assert sizes is not None and not isinstance(sizes, int)
    if isinstance(sizes, str) or not sizes:
        raise PipelineConfigError(
            f"tensor_parallel={sizes!r}: give one size or a tuple of sizes, e.g. (1, 2, 4)"
        )
    for size in sizes:
        check_size(size)
    if options.schedule != AUTO:
        raise PipelineConfigError(
            f"tensor_parallel={tuple(sizes)!r}: a range of sizes is searched by "
            f"schedule='auto', not schedule={options.schedule!r}; give schedule='auto' or one size"
        )
    if max(sizes) > 1 and options.tensor_parallel_plan is None:
        raise PipelineConfigError(
            f"tensor_parallel={tuple(sizes)!r} needs tensor_parallel_plan: which linears to "
            "split, e.g. twobp.models.tensor_parallel_plan('llama')"
        )
    apart = {
        "n_microbatches='auto'": options.n_microbatches == AUTO,
        "recompute='auto'": options.rebuilds,
        "costs='profile'": isinstance(options.costs, str),
    }
    chosen = [name for name, on in apart.items() if on]
    if chosen:
        raise PipelineConfigError(
            f"tensor_parallel={tuple(sizes)!r}: {', '.join(chosen)} is not searched with "
            "the size; give n_microbatches as a number, recompute by name, costs as a model "
            "or None"
        )


def refuse_planning_apart(options: PipelineOptions) -> None:
    """Refuse, with tensor parallelism, what each pipeline would plan from its own
    measurements (the ``T`` pipelines must run one plan).

    Raises:
        PipelineConfigError: naming the option and what to give.
    """
    apart = {
        "schedule='auto'": options.schedule == AUTO,
        "n_microbatches='auto'": options.n_microbatches == AUTO,
        "partition='balanced'": options.partition == "balanced",
        "costs='profile'": isinstance(options.costs, str) and options.costs == PROFILE,
        "recompute='auto'": options.rebuilds,
    }
    chosen = [name for name, on in apart.items() if on]
    if chosen:
        raise PipelineConfigError(
            f"tensor_parallel: {', '.join(chosen)} plans from what each tensor-parallel "
            "pipeline would measure apart; give a schedule by name, n_microbatches as a number "
            "and a partition (or None)"
        )
