"""The optimizer state sharded over the ranks that hold a parameter (ZeRO-1).

:meth:`twobp.runtime.Pipeline.shard_optimizer` builds a plain torch optimizer
over this rank's *shards*: each bucket of replicated parameters (see
:mod:`twobp.runtime.communication.reduction`) becomes one padded flat buffer,
the parameters become views of it, and the rank owns one contiguous shard of
it (:class:`~twobp.runtime.communication.sharding.ShardLayout`). What it holds
per bucket (:class:`FlatShard`):

* the *master shard*, the optimizer's parameter: a view of the flat buffer,
  or a float32 copy of it when the parameters are half precision;
* its gradient, the rank's shard of the sum over the replicas, which the
  stage's ``R`` reduce-scatters; the parameters' own full gradients are
  dropped at ``R`` (only the shard of the sum is kept, ZeRO-2's saving of
  gradient memory between steps);
* the optimizer's state of the shard (``exp_avg``, ``exp_avg_sq``), about
  ``1 / D`` of the unsharded state.

After ``optimizer.step()`` a hook starts the all-gather of every updated
shard into its flat buffer in the background, in the order of this rank's
stages' first forwards (and within a stage, of its blocks). Each block of a
stage waits for the gathers of its own parameters just before it runs (a
forward pre-hook; a compiled block, a stage compiled whole (``compile=True``),
and parameters outside the stage's blocks, are waited for before the stage's
forward starts). So the gathers
overlap the end of the step (``zero_grad``, loading the next batch), the
start of the next one, and on the first stage of the first rank its first
forward's first blocks. Reading the parameters
through the pipeline (``parameters()``, ``state_dict()``, ``save``) waits for
them too. Parameters held by one rank only (no replica) are stepped whole.

A step's reduced shards become the masters' gradients only when the step is
settled (:meth:`ShardedParameters.commit`); a failed or skipped step leaves
them as they were, and steps without ``zero_grad`` between them accumulate.

With ``shard_parameters=True`` (ZeRO-3) the shards are made when the pipeline
is built, every master is a tensor of its own, and the flat buffers hold
nothing between steps: each step gathers them (:meth:`ShardedParameters.gather_for_step`)
and frees each stage's after its last read of them
(:mod:`twobp.runtime.execution.residency`), so that a rank holds its stages'
full weights only while they are read.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from twobp.engine.compiled import is_compiled
from twobp.runtime.communication.reduction import Bucket, GradientReducer
from twobp.runtime.communication.sharding import ParameterGathers, ShardLayout
from twobp.runtime.errors import PipelineConfigError
from twobp.schedule.action import Kind
from twobp.schedule.schedule import Schedule

HALF = (torch.float16, torch.bfloat16)
"""Parameter dtypes whose shards the optimizer steps as a float32 master copy."""


@dataclass
class FlatShard:
    """One bucket of parameters as a flat buffer, and this rank's shard of it.

    Args:
        bucket: the reducer's bucket (its key, group and parameters).
        layout: how the flat buffer is cut over the bucket's ranks.
        names: the parameters' names in the single-process model.
        flat: the padded flat buffer; the parameters are views of it.
        master: the optimizer's parameter for this rank's shard.
        stages: this rank's stages whose forward waits for the whole bucket
            before it starts (those that read one of its parameters outside
            a block that waits for its own).
        readers: this rank's stages that read one of its parameters.
        pending: the last step's reduced shard, until the step is settled.
    """

    bucket: Bucket
    layout: ShardLayout
    names: tuple[str, ...]
    flat: Tensor
    master: nn.Parameter
    stages: frozenset[int]
    readers: frozenset[int] = frozenset()
    pending: Tensor | None = field(default=None, repr=False)

    @property
    def gathered(self) -> bool:
        """True while the flat buffer holds its elements (always, unless parameters are sharded)."""
        return self.flat.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Let go of the flat buffer's elements; the parameters, views of it, stay as objects."""
        self.flat.untyped_storage().resize_(0)

    def allocate(self) -> None:
        """Give the flat buffer its elements back (their values are what a gather writes)."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.layout.padded * self.flat.element_size())

    @property
    def copies_master(self) -> bool:
        """True if the master is a float32 copy (half-precision parameters)."""
        return self.flat.dtype in HALF

    def receive(self, shard: Tensor) -> None:
        """Keep a step's reduced shard until the step is settled; the shards of several
        reduce-scatters in one step (one after each ``W``) add up."""
        shard = shard.to(self.master.dtype)
        self.pending = shard if self.pending is None else self.pending.add_(shard)


class ShardedParameters:
    """This rank's shards of its replicated parameters, and the gathers that undo them.

    Args:
        reducer: the pipeline's gradient reducer; its parameter buckets are
            reduce-scattered from now on.
        order: this rank's stages in the order of their ``R`` in the schedule.
        stage_modules: this rank's stages' modules, by stage.
        names: ``id(parameter) -> name`` in the single-process model.
        rank: this rank (for messages).
        timeout: seconds a gather may wait for the other ranks.
        forward_order: this rank's stages in the order of their first ``F``
            in the schedule: the order of the gathers.
        resident: False under ``shard_parameters=True``: the flat buffers are
            freed between steps and every master is a tensor of its own.
    """

    def __init__(
        self,
        reducer: GradientReducer,
        order: Sequence[int],
        stage_modules: Mapping[int, nn.Module],
        names: Mapping[int, str],
        rank: int,
        timeout: float,
        forward_order: Sequence[int] = (),
        resident: bool = True,
    ) -> None:
        self.rank = rank
        self.resident = resident
        """False under ``shard_parameters=True``: full weights only while a step reads them."""
        self.gathered_peak = 0
        """The most bytes of gathered flat buffers held at once in the last step
        (``shard_parameters=True``)."""
        self._released: set[int] = set()
        self.free_before_w = True
        """Free each stage's gathered weights after its last read of the step (its last
        ``I``: ``W`` reads none); False keeps them through its last ``W``, as a sharding
        that frees after the backward does (to measure what 2BP saves)."""
        self.peak_freed_before_w = 0
        """The most bytes of activations, stashes and gathered weights held at once after a
        compute action of the last step with the weights freed after each stage's last
        read: measured from the flat buffers held if :attr:`free_before_w`, else counted."""
        self.peak_freed_after_w = 0
        """The same had each stage kept its weights until its last compute action (``W``):
        measured if not :attr:`free_before_w`, else counted; the same stashes and
        activations."""
        self.scatter_each_w: bool | None = False
        """Reduce-scatter a stage's whole gradients at its ``R`` only (False, the default),
        after each of its ``W`` or ``B`` (True), or after each where the order of the
        rank's actions lets that lower the peak (None): see
        :mod:`twobp.schedule.gradient_scatter`."""
        self.whole_gradients_peak = 0
        """The most bytes of whole gradients (the parameters' own, before they are
        reduce-scattered) held after a compute action of the last step
        (``shard_parameters=True``)."""
        self.scattering_peak = 0
        """The most bytes of whole gradients held at once by reduce-scatters in flight after
        an action of the last step (timing-dependent: how soon each completes)."""
        self.scattered_each_w = False
        """Whether some stage reduce-scattered its gradients after a ``W`` in the last step."""
        self._scattered_now = 0
        self._whole = False
        self._optimizer: Callable[[], torch.optim.Optimizer | None] = _nothing
        self.gathers = ParameterGathers(rank, timeout)
        readers: dict[int, set[int]] = {}
        for stage, module in stage_modules.items():
            for p in module.parameters():
                readers.setdefault(id(p), set()).add(stage)
        by_stage = reducer.by_stage
        self.shards: list[FlatShard] = []
        for stage in order:
            for bucket in by_stage.get(stage, ()):
                if bucket.parameters:
                    self.shards.append(_flat_shard(bucket, rank, names, readers, resident))
        first = {stage: i for i, stage in reversed(list(enumerate(forward_order)))}
        self._gather_order = sorted(
            range(len(self.shards)),
            key=lambda i: (
                min((first.get(s, len(first)) for s in self.shards[i].stages), default=0),
                i,
            ),
        )
        self._hooks = self._wait_by_block(stage_modules, readers)
        sharded = {id(p) for s in self.shards for p in s.bucket.parameters}
        seen: set[int] = set()
        self.whole: list[nn.Parameter] = []
        """The parameters held by this rank alone, stepped whole."""
        for module in stage_modules.values():
            for p in module.parameters():
                if id(p) not in sharded and id(p) not in seen:
                    seen.add(id(p))
                    self.whole.append(p)

    def _wait_by_block(
        self, stage_modules: Mapping[int, nn.Module], readers: Mapping[int, set[int]]
    ) -> list[RemovableHandle]:
        """A forward pre-hook on every block that waits for its own buckets' gathers; each
        bucket's stages become those that still wait for it whole (a parameter outside
        such a block)."""
        handles = []
        covered: dict[int, set[int]] = {}
        for stage, module in stage_modules.items():
            if is_compiled(module):
                continue  # compiled whole (compile=True): its forward is one compiled frame
            for block in module.children():
                if is_compiled(block):
                    continue  # a hook would run inside the compiled graph
                own = {id(p) for p in block.parameters()}
                indices = frozenset(
                    i
                    for i, shard in enumerate(self.shards)
                    if any(id(p) in own for p in shard.bucket.parameters)
                )
                if not indices:
                    continue
                covered.setdefault(stage, set()).update(own)
                handles.append(block.register_forward_pre_hook(self._block_hook(indices)))
        for shard in self.shards:
            shard.stages = frozenset(
                s
                for p in shard.bucket.parameters
                for s in readers.get(id(p), ())
                if id(p) not in covered.get(s, set())
            )
        return handles

    def _block_hook(self, indices: frozenset[int]) -> Callable[..., None]:
        def wait_own(_module: nn.Module, _args: Any) -> None:
            if self.gathers.in_flight:
                self.gathers.wait_shards(indices)

        return wait_own

    @property
    def gather_order(self) -> list[FlatShard]:
        """The shards in the order their gathers start (that of the forwards that read them)."""
        return [self.shards[i] for i in self._gather_order]

    def route(self, reducer: GradientReducer) -> None:
        """Have ``reducer`` reduce-scatter every bucket into its shard from now on."""
        for shard in self.shards:
            reducer.scatter(shard.bucket, shard.layout, shard.receive)

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: the master shards, then the unreplicated parameters."""
        return [s.master for s in self.shards] + self.whole

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Gather the updated shards after every ``optimizer.step()``."""
        optimizer.register_step_pre_hook(lambda *_: self.gathers.wait())
        if self.resident:
            optimizer.register_step_post_hook(lambda *_: self.start_gathers())
        self._optimizer = weakref.ref(optimizer)
        # Every bucket's master is one tensor in one group: no group can take a part of it.
        setattr(optimizer, "add_param_group", _refuse_groups(self.rank))  # noqa: B010

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer over these shards, once made (``Pipeline.shard_optimizer``)."""
        return self._optimizer()

    def steps(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """True if ``optimizer`` is the one over these shards."""
        return optimizer is not None and self._optimizer() is optimizer

    # -- gradients -------------------------------------------------------------------

    @torch.no_grad()
    def commit(self) -> None:
        """The step succeeded: its reduced shards join the masters' gradients."""
        for shard in self.shards:
            if shard.pending is None:
                continue
            grad = shard.master.grad
            shard.master.grad = shard.pending if grad is None else grad.add_(shard.pending)
            shard.pending = None

    @torch.no_grad()
    def divide_pending(self, divisor: float) -> None:
        """Divide the step's reduced shards, not yet committed, by ``divisor``."""
        for shard in self.shards:
            if shard.pending is not None:
                shard.pending.div_(divisor)

    def discard(self) -> None:
        """The step failed or was skipped: forget its reduced shards."""
        for shard in self.shards:
            shard.pending = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the masters' gradients."""
        for shard in self.shards:
            if shard.master.grad is None:
                continue
            if set_to_none:
                shard.master.grad = None
            else:
                shard.master.grad.zero_()

    def gradients(self) -> list[Tensor]:
        """The masters' gradients (each element of a replicated parameter in one shard)."""
        return [s.master.grad for s in self.shards if s.master.grad is not None]

    def gradients_of(self, keep: Callable[[nn.Parameter], bool]) -> list[Tensor]:
        """Views of the masters' gradients over the parts of the parameters ``keep`` keeps."""
        out = []
        for shard in self.shards:
            grad = shard.master.grad
            if grad is None:
                continue
            at = 0
            for index, first, stop in shard.layout.pieces():
                if keep(shard.bucket.parameters[index]):
                    out.append(grad[at : at + stop - first])
                at += stop - first
        return out

    # -- parameters ------------------------------------------------------------------

    @torch.no_grad()
    def start_gathers(self) -> None:
        """All-gather every updated shard into its flat buffer, in the background, in
        the order the forwards read them."""
        self.gathers.wait()
        for index in self._gather_order:
            shard = self.shards[index]  # the index names the gather (see wait_shards)
            layout = shard.layout
            if shard.copies_master:
                mine = shard.master.detach().to(shard.flat.dtype)
            else:
                mine = shard.flat[layout.start : layout.stop]
            group = shard.bucket.process_group(self.rank)
            self.gathers.start(shard.flat, mine, group, shard.stages, shard.bucket.key, index)

    def wait(self, stage: int | None = None) -> None:
        """Wait for the gathers of ``stage``'s parameters (None: all)."""
        if self.gathers.in_flight:
            self.gathers.wait(stage)

    # -- parameters sharded between and within steps (shard_parameters=True) -----------

    @torch.no_grad()
    def gather_for_step(self) -> None:
        """Allocate every flat buffer and start gathering the masters into it, in the
        order the forwards read them; the forwards wait for them (see :meth:`wait`)."""
        if self.resident:
            return
        self.gathers.wait()
        self._released.clear()
        self.gathered_peak = 0
        self.peak_freed_before_w = self.peak_freed_after_w = 0
        self.whole_gradients_peak = self._scattered_now = 0
        self.scattered_each_w = False
        self.scattering_peak = 0
        for index in self._gather_order:
            shard = self.shards[index]
            shard.allocate()
            mine = shard.master.detach().to(shard.flat.dtype)
            group = shard.bucket.process_group(self.rank)
            self.gathers.start(shard.flat, mine, group, shard.stages, shard.bucket.key, index)
        self._count_gathered()

    def release(self, stage: int) -> None:
        """``stage`` read its weights for the last time in this step: free each bucket
        that no stage of this rank still reads."""
        if self.resident:
            return
        self._released.add(stage)
        for index, shard in enumerate(self.shards):
            if shard.gathered and shard.readers <= self._released:
                if self.gathers.in_flight:
                    self.gathers.wait_shards(frozenset({index}))
                shard.free()

    def scattered(self, nbytes: int) -> None:
        """The action just run started reduce-scatters of ``nbytes`` of whole gradients."""
        self._scattered_now += nbytes
        self.scattered_each_w = True

    def in_flight(self, nbytes: int) -> None:
        """``nbytes`` of whole gradients are held by reduce-scatters not yet complete."""
        self.scattering_peak = max(self.scattering_peak, nbytes)

    def observe(
        self, between: int, read: frozenset[int], used: frozenset[int], during: bool = False
    ) -> None:
        """After a compute action: ``between`` bytes of activations and stashes, the whole
        gradients held now (the parameters' own, and those a reduce-scatter the action
        started copied), plus the gathered weights held now (the bytes of the flat
        buffers), and plus those that freeing the other way would hold: each bucket until
        its stages are past their last read (``read``) or their last compute action
        (``used``). Keeps the peaks of both, and of the whole gradients. ``during``: the
        moment before the end of a ``W`` or ``B`` (``between`` as before it ran)."""
        if self.resident:
            return
        whole = self._scattered_now + sum(
            p.grad.untyped_storage().nbytes()
            for s in self.shards
            for p in s.bucket.parameters
            if p.grad is not None
        )
        if not during:
            self._scattered_now = 0
        self.whole_gradients_peak = max(self.whole_gradients_peak, whole)
        between += whole
        held = between + sum(s.flat.untyped_storage().nbytes() for s in self.shards)
        other = between + sum(
            s.layout.padded * s.flat.element_size()
            for s in self.shards
            if not s.readers <= (used if self.free_before_w else read)
        )
        before, after = (held, other) if self.free_before_w else (other, held)
        self.peak_freed_before_w = max(self.peak_freed_before_w, before)
        self.peak_freed_after_w = max(self.peak_freed_after_w, after)

    def release_all(self) -> None:
        """Free every flat buffer (the step ended or failed; no-op unless sharded)."""
        if self.resident:
            return
        self.gathers.wait()
        for shard in self.shards:
            shard.free()

    def _count_gathered(self) -> None:
        held = sum(s.flat.untyped_storage().nbytes() for s in self.shards)
        self.gathered_peak = max(self.gathered_peak, held)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole while the context runs (collective with the parameters'
        other holders under ``shard_parameters=True``; nothing otherwise)."""
        if self.resident or self._whole:
            yield  # nothing to gather, or gathered by an enclosing call
            return
        self.gather_for_step()
        self.gathers.wait()
        self._whole = True
        try:
            yield
        finally:
            self._whole = False
            self.release_all()

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the parameters into the float32 masters (after they were loaded); under
        ``shard_parameters=True``, into every master (inside :meth:`gathered`)."""
        self.wait()
        for shard in self.shards:
            if shard.copies_master or not self.resident:
                shard.master.copy_(shard.flat[shard.layout.start : shard.layout.stop])

    @torch.no_grad()
    def load_masters(self, masters: Mapping[int, Tensor]) -> None:
        """Copy loaded float32 master shards (by shard index) into the masters."""
        for index, flat in masters.items():
            self.shards[index].master.copy_(flat)

    def abandon(self) -> None:
        """Forget the gathers in flight and the blocks' hooks (the pipeline closes)."""
        self.gathers.abandon()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- what a checkpoint reads ---------------------------------------------------------

    def pieces(self) -> Iterator[tuple[FlatShard, str, int, int, int]]:
        """Each part of a parameter in this rank's shards: ``(shard, name, first,
        stop, at)``, elements ``first:stop`` of the flattened parameter ``name``, at
        ``at`` in the master shard."""
        for shard in self.shards:
            at = 0
            for index, first, stop in shard.layout.pieces():
                yield shard, shard.names[index], first, stop, at
                at += stop - first


def shard_optimizer(
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: Mapping[str, Any],
    *,
    reducer: GradientReducer | None,
    schedule: Schedule,
    pp_rank: int,
    stage_modules: Mapping[int, nn.Module],
    names: Mapping[int, str],
    rank: int,
    timeout: float,
    existing: ShardedParameters | None = None,
) -> tuple[torch.optim.Optimizer, ShardedParameters]:
    """``optimizer_class`` over this rank's shards, and the shards (``Pipeline.shard_optimizer``).

    The buckets are laid out in the order of this rank's stages' ``R`` in
    ``schedule`` (then the stages without one), gathered in the order of their
    first ``F``; ``reducer`` reduce-scatters them from now on.

    Raises:
        PipelineConfigError: if ``optimizer_class`` is not an optimizer class,
            ``optimizer_kwargs`` name ``params``, the shards exist already
            (``existing``), or no parameter here is held by several ranks.
    """
    is_class = isinstance(optimizer_class, type)
    if not (is_class and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise PipelineConfigError(
            f"shard_optimizer({optimizer_class!r}): pass an optimizer class such as "
            "torch.optim.AdamW, and its arguments as keywords"
        )
    if "params" in optimizer_kwargs:
        raise PipelineConfigError(
            f"rank {rank}: shard_optimizer makes the optimizer's parameters itself (this "
            "rank's shards, in one param group); pass only its options (lr=..., "
            "weight_decay=...). Param groups with other options per parameter are not "
            "supported on a sharded optimizer: use one setting for all, or a plain "
            "optimizer over pipe.parameters() with your groups"
        )
    if existing is not None and not existing.resident and existing.optimizer is None:
        # shard_parameters=True: the shards exist since the pipeline was built.
        optimizer = optimizer_class(existing.optimizer_parameters(), **optimizer_kwargs)
        existing.attach(optimizer)
        return optimizer, existing
    if existing is not None:
        raise PipelineConfigError(
            f"rank {rank}: this pipeline already has a sharded optimizer; keep the "
            "one shard_optimizer returned (its state_dict and pipe.load restore it)"
        )
    if reducer is None or not any(b.parameters for bs in reducer.by_stage.values() for b in bs):
        raise PipelineConfigError(
            f"rank {rank}: shard_optimizer needs parameters held by several ranks "
            "(data_parallel > 1, chimera, dualpipe, or a weight tied across ranks); this "
            "pipeline holds each parameter on one rank: use "
            "optimizer_class(pipe.parameters(), ...) instead"
        )
    sharded = make_shards(reducer, schedule, pp_rank, stage_modules, names, rank, timeout)
    optimizer = optimizer_class(sharded.optimizer_parameters(), **optimizer_kwargs)
    sharded.attach(optimizer)
    return optimizer, sharded


def make_shards(
    reducer: GradientReducer,
    schedule: Schedule,
    pp_rank: int,
    stage_modules: Mapping[int, nn.Module],
    names: Mapping[int, str],
    rank: int,
    timeout: float,
    resident: bool = True,
) -> ShardedParameters:
    """This rank's shards of its replicated parameters, which ``reducer`` reduce-scatters
    from now on: laid out in the order of this rank's stages' ``R`` in ``schedule`` (then
    the stages without one), gathered in the order of their first ``F``.

    Args:
        resident: False for ``shard_parameters=True``: the flat buffers are freed now
            and each step gathers them (see :class:`ShardedParameters`).
    """
    actions = schedule.actions[pp_rank]
    order = [a.stage for a in actions if a.kind is Kind.REDUCE]
    order += [s for s in stage_modules if s not in order]
    sharded = ShardedParameters(
        reducer,
        order,
        stage_modules,
        names,
        rank,
        timeout,
        [a.stage for a in actions if a.kind is Kind.FORWARD],
        resident=resident,
    )
    sharded.route(reducer)
    return sharded


def _flat_shard(
    bucket: Bucket,
    rank: int,
    names: Mapping[int, str],
    readers: Mapping[int, set[int]],
    resident: bool = True,
) -> FlatShard:
    """The bucket's parameters moved into one padded flat buffer, and this rank's shard."""
    group = bucket.process_group(rank)
    params = bucket.parameters
    layout = ShardLayout(
        tuple(p.numel() for p in params), dist.get_world_size(group), dist.get_rank(group)
    )
    first = params[0]
    with torch.no_grad():
        flat = torch.zeros(layout.padded, dtype=first.dtype, device=first.device)
        grads = torch.zeros_like(flat)
        any_grad = False
        for p, offset in zip(params, layout.offsets, strict=True):
            view = flat[offset : offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            if p.grad is not None:
                # Gradients accumulated before the optimizer existed: its shard of them.
                grads[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
                any_grad = True
                p.grad = None
        own = flat[layout.start : layout.stop]
        if first.dtype in HALF:
            own = own.float()
        elif not resident:
            own = own.clone()  # the flat buffer is freed between steps
        master = nn.Parameter(own)
        if any_grad:
            master.grad = grads[layout.start : layout.stop].to(master.dtype).clone()
    stages = frozenset(s for p in params for s in readers.get(id(p), ()))
    shard = FlatShard(
        bucket, layout, tuple(names[id(p)] for p in params), flat, master, stages, stages
    )
    if not resident:
        shard.free()
    return shard


def _refuse_groups(rank: int) -> Callable[[dict[str, Any]], None]:
    def add_param_group(param_group: dict[str, Any]) -> None:
        raise PipelineConfigError(
            f"rank {rank}: a sharded optimizer (pipe.shard_optimizer) steps this rank's shards "
            "in one param group; it takes no other group. Use one setting for all parameters, "
            "or a plain optimizer over pipe.parameters() with your groups"
        )

    return add_param_group


def _nothing() -> None:
    return None
