"""The cost model: how long each action takes and how much memory it holds.

Times are per stage and per micro-batch, in seconds (or any unit, as long as
one is used throughout: unit costs ``F=1,I=1,W=1`` are the usual way to draw
schedules). The weight pass ``W`` may concatenate several micro-batches, and
its time for ``n`` of them is either ``n`` times the one-micro-batch time or
read from a measured table, so that the gain of concatenation can be modelled.

Memory (bytes, or any unit) follows a deliberately small model, which the
memory entries of the kind table (:mod:`twobp.schedule.kinds`) state and the
simulator reads from there:

* ``activation_bytes[s]`` per micro-batch are held on stage ``s`` from the
  start of its forward until the end of its backward-input ``I`` (or full
  backward ``B``);
* ``weight_grad_bytes[s]`` per micro-batch (the derivatives and inputs that
  the weight pass still needs) are held from the end of ``I`` until the end of
  the ``W`` that covers the micro-batch;
* ``parameter_bytes[s]`` are held all the time (weights and gradients of the
  stage, or with the optimiser state counted in them);
* ``optimizer_bytes[s]``, the stage's optimiser state (unsharded), are held all
  the time too; with ``shard_optimizer`` each of the ``n`` ranks that hold the
  stage holds ``1 / n`` of it (ZeRO-1, ``Pipeline.shard_optimizer``). Zero by default;
* ``weight_rebuild_bytes[s]`` per micro-batch are held while a ``W`` runs, for
  each micro-batch of the group it works on (``weight_group_size`` at most):
  the stash that derivative checkpointing rebuilds (see
  :mod:`twobp.sim.recompute`). Zero by default.

Communication: a stage boundary ``s -> s + 1`` carries ``send_bytes[s]``
per micro-batch, forward (activations) and backward (their gradients) alike;
a transfer between different ranks takes ``send_latency + bytes / bandwidth``,
one on the same rank takes no time.

Reduction: a stage held by several ranks (data parallel, Chimera's two
pipelines) reduces its weight gradients over them once per step, in the
background (the ``R`` action); ``reduce[s]`` is the time of that all-reduce.
:func:`allreduce_time` gives it for a ring over ``n`` ranks. With
``shard_optimizer``, ``R`` reduce-scatters instead (:func:`reduce_scatter_time`,
half the all-reduce), and the updated parameters are all-gathered after the
optimizer step, before the stage's first ``F`` of the next step: ``gather[s]``
is that time, at the start of the simulated step (see
:func:`twobp.sim.result.gather_wait`). The gathers of a rank run in the order
of its stages' first ``F``; with ``gather_pieces = k`` a first ``F`` runs
through its stage in ``k`` equal parts (its blocks), each once its own part
of the parameters has arrived, as the runtime waits block by block.

Contention: ranks that compute at the same time may slow each other (on a
CPU they share cores, caches and memory bandwidth). ``contention`` is how many
times longer a compute action takes while every rank of the pipeline computes
at once than while its rank computes alone; with ``k`` of ``n`` ranks
computing, each runs ``1 + (contention - 1) * (k - 1) / (n - 1)`` times slower
(``n`` is the number of ranks of the simulated schedule; ``n = 1`` or
``k = 1``: no slowdown). The times of ``F``, ``I``, ``W`` and ``B`` in the
model are the alone times. The default ``1.0`` means no contention (separate
devices).

The file format is described in :mod:`twobp.sim.cost_io`. This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

from twobp.schedule.action import Action, Kind
from twobp.schedule.kinds import kind_spec

PerStage = tuple[float, ...]

PER_STAGE_FIELDS = (
    "forward",
    "forward_full",
    "backward_input",
    "backward_weight",
    "backward_full",
    "send_bytes",
    "activation_bytes",
    "weight_grad_bytes",
    "parameter_bytes",
    "reduce",
    "weight_rebuild_bytes",
    "optimizer_bytes",
    "gather",
    "gathered_bytes",
)
"""The fields of :class:`CostModel` that hold one value per stage."""


def _per_stage(name: str, values: Sequence[float], n_stages: int) -> PerStage:
    out = tuple(float(v) for v in values)
    if len(out) != n_stages:
        raise ValueError(
            f"cost model: {name} has {len(out)} entries, expected one per stage ({n_stages})"
        )
    bad = [i for i, v in enumerate(out) if not (v >= 0 and math.isfinite(v))]
    if bad:
        raise ValueError(
            f"cost model: {name} must be finite and >= 0, got {out[bad[0]]} for stage {bad[0]}"
        )
    return out


@dataclass(frozen=True)
class CostModel:
    """Per-stage times, transfer costs and memory sizes of a pipeline.

    Args:
        forward: time of ``F`` of one micro-batch, per stage.
        backward_input: time of ``I`` (backward-p1) of one micro-batch, per stage.
        backward_weight: time of ``W`` (backward-p2) of one micro-batch, per stage.
        backward_full: time of a fused ``B`` per stage; ``None`` means
            ``backward_input + backward_weight``.
        weight_concat: per stage, a measured table ``{n: time}`` of ``W`` over
            ``n`` concatenated micro-batches, or ``None`` for ``n * W(1)``.
            Between measured points time is interpolated linearly (through
            ``(0, 0)``); beyond the last point it grows with the slope of the
            last segment.
        send_latency: fixed time of one transfer between two ranks.
        send_overhead: time the sending rank itself spends on each transfer
            to another rank, after the action that made it and before its next
            one (on a CPU transport the caller copies the message into the
            connection while the peer computes; about 0 on a GPU). Default 0.
        bandwidth: bytes per second between two ranks (``inf``: free).
        send_bytes: bytes per micro-batch crossing boundary ``s -> s + 1``.
        activation_bytes: bytes per micro-batch held from ``F`` until ``I``/``B``.
        weight_grad_bytes: bytes per micro-batch held from ``I`` until ``W``.
        parameter_bytes: bytes held all the time, per stage.
        reduce: time of the all-reduce of a stage's weight gradients over its
            replicas (the ``R`` action, in the background); default 0.
        reduce_bandwidth: bytes per second that each rank of a ring all-reduce
            moves, as :meth:`with_reduction` costs it (``None``: ``bandwidth``).
            Measured apart from ``bandwidth`` because an all-reduce also sums
            and copies: over gloo on CPU ranks it moved 1.4-2.1 GB/s where a
            point-to-point message of a stage boundary moved 2.4-49 GB/s.
        contention: how many times longer a compute action takes while every
            rank of the pipeline computes at once than while its rank
            computes alone; with ``k`` of ``n`` ranks computing, each runs
            ``1 + (contention - 1) * (k - 1) / (n - 1)`` times slower (``n``:
            ranks of the simulated schedule; ``n = 1`` or ``k = 1``: no
            slowdown). The times above are the alone times. ``1.0``: none.
        meta: free-form description (model, device, ...) kept with the file.
        weight_rebuild_bytes: bytes per micro-batch that a ``W`` holds while it
            runs, for each micro-batch of one group (``None``: zeros).
        weight_group_size: the most micro-batches one ``W`` concatenates at
            once: a ``W`` of more runs as consecutive groups, its time the
            sum of theirs (``None``: no cap). Set with
            :func:`twobp.sim.recompute.with_recompute`; not saved in cost files.
        optimizer_bytes: bytes of each stage's optimizer state, unsharded,
            held all the time (``None``: zeros, not counted).
        gather: time of the all-gather of a stage's updated parameters over
            its replicas before its first ``F`` (a sharded optimizer; default 0).
        shard_optimizer: the optimizer state is sharded over each stage's
            replicas (ZeRO-1): :meth:`with_reduction` times ``R`` as a
            reduce-scatter and ``gather`` as an all-gather, and divides
            ``optimizer_bytes`` by the replicas. Not saved in cost files.
        gather_pieces: the equal parts (blocks) a stage's first ``F`` reads its
            gathered parameters in, one after another: part ``k`` runs once
            the ``k``-th part of the stage's gather has arrived (the runtime
            waits for the buckets of each block before the block runs). ``1``:
            the whole stage is gathered first. Not saved in cost files.
        gathered_bytes: bytes of a stage's whole weights that a rank holds gathered
            while it needs them (``shard_parameters=True``: from the start of the
            stage's first ``F`` to the end of its last ``I`` or ``B``, or of its last
            ``W`` with ``free_before_w=False``); ``None``: zeros, nothing gathered.
            Not saved in cost files.
        free_before_w: free a stage's gathered weights after its last ``I`` (True, as
            the runtime does: ``W`` needs no weights) or only after its last ``W``.
        shard_parameters: the parameters and gradients are sharded over each stage's
            replicas too (ZeRO-3, ``Pipeline(shard_parameters=True)``): timed as
            ``shard_optimizer`` (each step all-gathers a stage's weights before its first
            ``F`` and ``R`` reduce-scatters its gradients), and :meth:`with_reduction`
            divides ``parameter_bytes`` by the replicas as well; ``gathered_bytes`` are
            the whole weights a rank holds within the step. Not saved in cost files.
        scatter_each_w: with ``shard_parameters``, where a stage's whole gradients are
            reduce-scattered, as ``ShardedParameters.scatter_each_w`` at run time: at ``R``
            (False, the default), after each ``W`` or ``B`` (True), or after each where the
            order of the actions lets that lower the peak (None;
            :mod:`twobp.schedule.gradient_scatter`). The memory model holds them
            accordingly (:func:`twobp.sim.memory.whole_gradient_changes`); the link time of
            the reduce-scatters before the last is not shared with the others.
        jitter: the spread of each action's time, as a fraction of it (the
            coefficient of variation measured over repeated steps): the
            simulator draws every action's time from a normal distribution of
            this relative spread around its cost (at least a tenth of it), the
            same draw for the same work (stage, kind, micro-batch) whatever the
            schedule, so policies compare on one draw (a ``W`` over several
            micro-batches takes the mean of theirs). A ``dynamic`` schedule places its ``W`` on the
            drawn times (as its runtime meets them), a static one keeps its
            placement. ``0``: exact times. Not saved in cost files.
        jitter_seed: which draw (an int).
        forward_full: time of ``F`` of one micro-batch on a stage whose
            backward is fused (``B``), which runs it without the 2BP engine;
            ``forward`` is that of a split stage (``I`` and ``W``). ``None``:
            ``forward``. :meth:`for_split` makes the model of a schedule that
            splits some stages and fuses others.

    Raises:
        ValueError: if a list does not have one finite, non-negative entry per
            stage, a concatenation table is malformed, or ``contention`` is
            not a finite number ``>= 1``.
    """

    forward: PerStage
    backward_input: PerStage
    backward_weight: PerStage
    backward_full: PerStage | None = None
    weight_concat: tuple[Mapping[int, float] | None, ...] | None = None
    send_latency: float = 0.0
    bandwidth: float = math.inf
    send_bytes: PerStage | None = None
    activation_bytes: PerStage | None = None
    weight_grad_bytes: PerStage | None = None
    parameter_bytes: PerStage | None = None
    reduce: PerStage | None = None
    contention: float = 1.0
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)
    weight_rebuild_bytes: PerStage | None = None
    weight_group_size: int | None = None
    send_overhead: float = 0.0
    reduce_bandwidth: float | None = None
    optimizer_bytes: PerStage | None = None
    gather: PerStage | None = None
    shard_optimizer: bool = False
    gather_pieces: int = 1
    forward_full: PerStage | None = None
    gathered_bytes: PerStage | None = None
    free_before_w: bool = True
    shard_parameters: bool = False
    scatter_each_w: bool | None = False
    jitter: float = 0.0
    jitter_seed: int = 0

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n < 1:
            raise ValueError("cost model: needs at least one stage")
        set_ = object.__setattr__
        set_(self, "forward", _per_stage("forward", self.forward, n))
        set_(self, "backward_input", _per_stage("backward_input", self.backward_input, n))
        set_(self, "backward_weight", _per_stage("backward_weight", self.backward_weight, n))
        full = self.backward_full
        if full is None:
            full = tuple(
                i + w for i, w in zip(self.backward_input, self.backward_weight, strict=True)
            )
        set_(self, "backward_full", _per_stage("backward_full", full, n))
        plain = self.forward if self.forward_full is None else self.forward_full
        set_(self, "forward_full", _per_stage("forward_full", plain, n))
        zeros = (0.0,) * n
        for name, default in (
            ("send_bytes", zeros),
            ("activation_bytes", (1.0,) * n),
            ("weight_grad_bytes", (1.0,) * n),
            ("parameter_bytes", zeros),
            ("reduce", zeros),
            ("weight_rebuild_bytes", zeros),
            ("optimizer_bytes", zeros),
            ("gather", zeros),
            ("gathered_bytes", zeros),
        ):
            value = getattr(self, name)
            set_(self, name, _per_stage(name, default if value is None else value, n))
        set_(self, "weight_concat", _check_concat(self.weight_concat, n))
        if not (self.send_latency >= 0 and math.isfinite(self.send_latency)):
            raise ValueError(
                f"cost model: send_latency must be finite and >= 0, got {self.send_latency}"
            )
        if not (self.send_overhead >= 0 and math.isfinite(self.send_overhead)):
            raise ValueError(
                f"cost model: send_overhead must be finite and >= 0, got {self.send_overhead}"
            )
        if not self.bandwidth > 0:
            raise ValueError(f"cost model: bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.reduce_bandwidth is not None and not self.reduce_bandwidth > 0:
            raise ValueError(
                f"cost model: reduce_bandwidth must be None or > 0 bytes/s, got "
                f"{self.reduce_bandwidth}"
            )
        if not (self.jitter >= 0 and math.isfinite(self.jitter)):
            raise ValueError(
                f"cost model: jitter must be a finite fraction >= 0, got {self.jitter}; use "
                "0 for exact times or the measured spread of an action's time (e.g. 0.1)"
            )
        if not (self.contention >= 1 and math.isfinite(self.contention)):
            raise ValueError(
                f"cost model: contention must be a finite number >= 1, got {self.contention}; "
                "use 1.0 for ranks that do not slow each other, or the measured slowdown of "
                "all ranks computing at once over one rank alone (e.g. 1.6)"
            )
        set_(self, "contention", float(self.contention))
        if self.weight_group_size is not None and self.weight_group_size < 1:
            raise ValueError(
                f"cost model: weight_group_size must be None or >= 1, got {self.weight_group_size}"
            )
        if not (isinstance(self.gather_pieces, int) and self.gather_pieces >= 1):
            raise ValueError(
                f"cost model: gather_pieces must be an int >= 1, got {self.gather_pieces!r}; "
                "use the number of blocks of a stage (1: the whole stage is gathered first)"
            )
        set_(self, "meta", dict(self.meta))

    @property
    def n_stages(self) -> int:
        """Number of stages the model describes."""
        return len(self.forward)

    @classmethod
    def uniform(
        cls,
        n_stages: int,
        f: float = 1.0,
        i: float = 1.0,
        w: float = 1.0,
        *,
        b: float | None = None,
        send_latency: float = 0.0,
        bandwidth: float = math.inf,
        send_bytes: float = 0.0,
        activation_bytes: float = 1.0,
        weight_grad_bytes: float = 1.0,
        parameter_bytes: float = 0.0,
        optimizer_bytes: float = 0.0,
        weight_concat: Mapping[int, float] | None = None,
        contention: float = 1.0,
        send_overhead: float = 0.0,
        reduce_bandwidth: float | None = None,
    ) -> CostModel:
        """The same costs for every stage.

        Args:
            n_stages: number of stages.
            f, i, w: times of ``F``, ``I`` and ``W`` (one micro-batch).
            b: time of a fused ``B``; ``None`` means ``i + w``.
            send_latency, bandwidth, send_bytes: transfer costs.
            activation_bytes, weight_grad_bytes, parameter_bytes: memory sizes
                (the defaults count memory in activations of one micro-batch).
            optimizer_bytes: the optimizer state of a stage, unsharded.
            weight_concat: a table ``{n: time}`` of concatenated ``W``.
            contention: slowdown of a compute action while every rank
                computes at once (see :class:`CostModel`).
            send_overhead: the sender's own time per transfer to another rank.
            reduce_bandwidth: bytes per second per rank of a ring all-reduce
                (``None``: ``bandwidth``).

        Returns:
            The cost model.

        Raises:
            ValueError: if ``n_stages < 1`` or a value is out of range.
        """
        if n_stages < 1:
            raise ValueError(f"cost model: n_stages must be >= 1, got {n_stages}")

        def rep(x: float) -> PerStage:
            return (float(x),) * n_stages

        return cls(
            forward=rep(f),
            backward_input=rep(i),
            backward_weight=rep(w),
            backward_full=None if b is None else rep(b),
            weight_concat=None if weight_concat is None else (dict(weight_concat),) * n_stages,
            send_latency=send_latency,
            bandwidth=bandwidth,
            send_bytes=rep(send_bytes),
            activation_bytes=rep(activation_bytes),
            weight_grad_bytes=rep(weight_grad_bytes),
            parameter_bytes=rep(parameter_bytes),
            optimizer_bytes=rep(optimizer_bytes),
            contention=contention,
            send_overhead=send_overhead,
            reduce_bandwidth=reduce_bandwidth,
        )

    def for_split(self, split: Iterable[int]) -> CostModel:
        """This model for a schedule that splits the backward of the stages ``split``
        (``I`` and ``W``) and fuses the others' (``B``): the forward of a fused
        stage is :attr:`forward_full`, without the 2BP engine.

        Returns the model itself where no forward changes.
        """
        assert self.forward_full is not None  # filled in by __post_init__
        chosen = set(split)
        forward = tuple(
            f if s in chosen else full
            for s, (f, full) in enumerate(zip(self.forward, self.forward_full, strict=True))
        )
        return self if forward == self.forward else replace(self, forward=forward)

    def w_time(self, stage: int, n_microbatches: int) -> float:
        """Time of one ``W`` of ``n_microbatches`` on ``stage``, in groups of
        ``weight_group_size`` at most."""
        group = self.weight_group_size
        if group is not None and n_microbatches > group:
            full, rest = divmod(n_microbatches, group)
            return full * self._w_group(stage, group) + self._w_group(stage, rest)
        return self._w_group(stage, n_microbatches)

    def _w_group(self, stage: int, n_microbatches: int) -> float:
        if n_microbatches == 0:
            return 0.0
        table = self.weight_concat[stage] if self.weight_concat is not None else None
        if table is None:
            return n_microbatches * self.backward_weight[stage]
        return _interpolate(table, n_microbatches)

    def weight_rebuild_peak(self, stage: int, n_microbatches: int) -> float:
        """Bytes a ``W`` of ``n_microbatches`` on ``stage`` holds while it runs."""
        assert self.weight_rebuild_bytes is not None
        group = self.weight_group_size
        held = n_microbatches if group is None else min(group, n_microbatches)
        return held * self.weight_rebuild_bytes[stage]

    @property
    def checkpoint_bytes(self) -> PerStage:
        """Bytes per micro-batch an ``IR`` keeps for its ``WR`` instead of a stash:
        the stage's input and its output gradient (what crosses its boundaries;
        stage 0's input is taken as large as what it sends on)."""
        assert self.send_bytes is not None
        sent = self.send_bytes
        return tuple((sent[s - 1] if s > 0 else sent[0]) + sent[s] for s in range(self.n_stages))

    def rebuild_time(self, stage: int) -> float:
        """Time a ``WR`` spends rebuilding the stash of one micro-batch: its ``F`` and ``I``."""
        return self.forward[stage] + self.backward_input[stage]

    def duration(self, action: Action) -> float:
        """Compute time of ``action``: the field its kind names in the kind
        table (``W`` through :meth:`w_time`, a ``WR`` plus
        :meth:`rebuild_time` per micro-batch), 0 for transfers."""
        field_name = kind_spec(action.kind).cost
        if field_name is None:
            return 0.0
        if field_name == "backward_weight":
            n = len(action.microbatches)
            time = self.w_time(action.stage, n)
            if action.kind is Kind.BACKWARD_WEIGHT_REBUILD:
                time += n * self.rebuild_time(action.stage)
            return time
        times: PerStage = getattr(self, field_name)
        return times[action.stage]

    def transfer_time(self, boundary: int) -> float:
        """Time for one micro-batch to cross boundary ``boundary -> boundary + 1``
        between two different ranks."""
        assert self.send_bytes is not None
        return self.send_latency + self.send_bytes[boundary] / self.bandwidth

    def split(self, parts: int) -> CostModel:
        """Cut every stage into ``parts`` equal consecutive stages.

        Used to run an interleaved schedule (``parts`` stages per rank) with
        costs given for one stage per rank: times and memory are divided by
        ``parts``; the bytes sent per boundary and ``contention`` (a property
        of the ranks, not of the stages) stay the same.

        Raises:
            ValueError: if ``parts < 1``.
        """
        if parts < 1:
            raise ValueError(f"cannot split stages into {parts} parts; use >= 1")
        if parts == 1:
            return self

        def cut(name: str, values: PerStage) -> PerStage:
            # Bytes crossing a boundary stay whole; time and memory divide.
            share = 1 if name == "send_bytes" else parts
            return tuple(v / share for v in values for _ in range(parts))

        concat = None
        if self.weight_concat is not None:
            concat = tuple(
                None if t is None else {n: v / parts for n, v in t.items()}
                for t in self.weight_concat
                for _ in range(parts)
            )
        return replace(self, weight_concat=concat, **self._per_stage_fields(cut))

    def tile(self, copies: int) -> CostModel:
        """The stages repeated ``copies`` times: the costs of a schedule of
        ``copies`` pipelines whose stages are numbered pipeline after pipeline.

        Raises:
            ValueError: if ``copies < 1``.
        """
        if copies < 1:
            raise ValueError(f"cannot tile a cost model {copies} times; use >= 1")
        if copies == 1:
            return self

        concat = None if self.weight_concat is None else tuple(self.weight_concat) * copies
        return replace(
            self,
            weight_concat=concat,
            **self._per_stage_fields(lambda _name, values: tuple(values) * copies),
        )

    def _per_stage_fields(self, change: Callable[[str, PerStage], PerStage]) -> dict[str, Any]:
        """Every per-stage list of the model, changed by ``change(name, values)``."""
        out = {}
        for name in PER_STAGE_FIELDS:
            values = getattr(self, name)
            assert values is not None  # filled in by __post_init__
            out[name] = change(name, values)
        return out

    def with_reduction(self, replicas: int, gradient_bytes: Sequence[float]) -> CostModel:
        """This model with the time of each stage's gradient all-reduce over ``replicas`` ranks.

        With :attr:`shard_optimizer` (or :attr:`shard_parameters`): the reduce-scatter
        of the gradients as ``reduce``, the all-gather of the updated parameters (as many
        bytes) as ``gather``, and ``optimizer_bytes`` divided by ``replicas``; with
        :attr:`shard_parameters`, ``parameter_bytes`` too.

        Args:
            replicas: ranks that hold each stage (data parallel degree, times
                2 under Chimera).
            gradient_bytes: bytes of each stage's weight gradients.

        Raises:
            ValueError: if ``gradient_bytes`` has not one entry per stage.
        """
        sizes = _per_stage("gradient_bytes", gradient_bytes, self.n_stages)
        bandwidth = self.bandwidth if self.reduce_bandwidth is None else self.reduce_bandwidth
        if (self.shard_optimizer or self.shard_parameters) and replicas > 1:
            half = tuple(
                reduce_scatter_time(b, replicas, bandwidth, self.send_latency) for b in sizes
            )
            assert self.optimizer_bytes is not None and self.parameter_bytes is not None
            held = self.parameter_bytes
            if self.shard_parameters:
                held = tuple(b / replicas for b in held)
            return replace(
                self,
                reduce=half,
                gather=half,
                optimizer_bytes=tuple(b / replicas for b in self.optimizer_bytes),
                parameter_bytes=held,
            )
        return replace(
            self,
            reduce=tuple(allreduce_time(b, replicas, bandwidth, self.send_latency) for b in sizes),
        )

    def for_schedule(self, n_stages: int, n_pipelines: int = 1) -> CostModel:
        """This model fitted to a schedule of ``n_stages`` stages in ``n_pipelines`` pipelines.

        Each pipeline gets the model's stages (see :meth:`for_stages`).

        Raises:
            ValueError: if a pipeline's stage count is not a multiple of the model's stages.
        """
        return self.for_stages(n_stages // n_pipelines).tile(n_pipelines)

    def for_stages(self, n_stages: int) -> CostModel:
        """This model fitted to a schedule of ``n_stages`` stages.

        Returns the model itself if the counts match, or :meth:`split` if
        ``n_stages`` is a multiple of the model's stages (an interleaved
        schedule with costs measured per rank).

        Raises:
            ValueError: if ``n_stages`` is not a multiple of the model's stages.
        """
        if n_stages == self.n_stages:
            return self
        if n_stages % self.n_stages:
            raise ValueError(
                f"the cost model has {self.n_stages} stages but the schedule has {n_stages}; "
                f"profile the model with {n_stages} stages (or a divisor of it)"
            )
        return self.split(n_stages // self.n_stages)


def _check_concat(
    tables: Sequence[Mapping[int, float] | None] | None, n_stages: int
) -> tuple[dict[int, float] | None, ...] | None:
    if tables is None:
        return None
    if len(tables) != n_stages:
        raise ValueError(
            f"cost model: backward_weight_concat has {len(tables)} tables, "
            f"expected one per stage ({n_stages})"
        )
    out: list[dict[int, float] | None] = []
    for stage, table in enumerate(tables):
        if table is None:
            out.append(None)
            continue
        clean = {int(n): float(t) for n, t in table.items()}
        if not clean or min(clean) < 1 or min(clean.values()) < 0:
            raise ValueError(
                f"cost model: W concatenation table of stage {stage} must map micro-batch counts "
                f">= 1 to times >= 0, got {dict(table)}"
            )
        out.append(dict(sorted(clean.items())))
    return tuple(out)


def _interpolate(table: Mapping[int, float], n: int) -> float:
    points = [(0, 0.0), *sorted(table.items())]
    for (n0, t0), (n1, t1) in pairwise(points):
        if n <= n1:
            return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
    (n0, t0), (n1, t1) = points[-2], points[-1]
    return max(0.0, t1 + (t1 - t0) * (n - n1) / (n1 - n0))


def allreduce_time(nbytes: float, n_ranks: int, bandwidth: float, latency: float) -> float:
    """Time of a ring all-reduce of ``nbytes`` over ``n_ranks`` ranks.

    ``2 (n - 1)`` steps, each moving ``nbytes / n`` per rank and paying the
    latency once: ``2 (n - 1) (latency + nbytes / (n * bandwidth))``; 0 for one rank.
    """
    if n_ranks <= 1:
        return 0.0
    return 2 * (n_ranks - 1) * (latency + nbytes / (n_ranks * bandwidth))


def reduce_scatter_time(nbytes: float, n_ranks: int, bandwidth: float, latency: float) -> float:
    """Time of a ring reduce-scatter (or all-gather) of ``nbytes`` over ``n_ranks`` ranks.

    ``n - 1`` steps, each moving ``nbytes / n`` per rank: half of
    :func:`allreduce_time`; 0 for one rank.
    """
    if n_ranks <= 1:
        return 0.0
    return (n_ranks - 1) * (latency + nbytes / (n_ranks * bandwidth))
