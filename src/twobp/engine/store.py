"""The per-stage store of the 2-stage backward: F, I, W and B of micro-batches.

One :class:`WeightGradStore` serves one pipeline stage (one module). Each
forward of a micro-batch runs under its :class:`~twobp.engine.capture.Capture`,
which sends every covered operation reading a stage parameter through a
deferred op. The store records which micro-batch each forward belongs to,
runs the input pass (I) as one plain autograd backward, keeps what the
deferred ops stash for their weight gradients, and runs the weight pass (W)
for any group of micro-batches as one concatenated operation per op.

A typical step of a stage::

    store = defer_weight_grads(stage_module)
    for mb in range(n):
        with store.forward(mb):
            outputs[mb] = stage_module(inputs[mb])
    for mb in range(n):
        input_grads[mb] = store.backward_input(mb, [outputs[mb]], [grads[mb]], [inputs[mb]])
    store.backward_weight(range(n))        # one W over all micro-batches
    store.finish_step()
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.autograd.variable import Variable

from twobp.engine.capture import Capture, running_capture
from twobp.engine.compiled import compiled_modules, keep_two_stage
from twobp.engine.coverage import (
    ParameterRoute,
    Route,
    format_report,
    observed_routes,
    predicted_routes,
)
from twobp.engine.deferred import DeferredOp
from twobp.engine.ops import HANDLERS
from twobp.engine.phases import MicrobatchPhases, TwoStageBackwardError
from twobp.engine.stash import CONCAT_ROWS, SharedRows, StashEntry, held_bytes

_OWNER = "_twobp_weight_grad_store"
"""The attribute by which a module names the store that defers its parameters."""

Rebuild = Callable[[int], tuple[Sequence[Tensor], Sequence[Tensor | None]]]
"""``rebuild(mb) -> (outputs, grad_outputs)``: re-runs the forward of micro-batch
``mb`` (as it first ran: same inputs, same random numbers) and returns its
outputs with their gradients, for :meth:`WeightGradStore.backward_weight`."""


class WeightGradStore:
    """Deferred weight gradients of one stage, kept per micro-batch.

    Build it with :func:`defer_weight_grads`.

    Args:
        module: the stage module; the forwards run in :meth:`forward` defer
            the weight gradients of its parameters.
        label: names the stage in error messages and the report (e.g.
            ``"rank 1 stage 3"``).

    Raises:
        TwoStageBackwardError: if a submodule is already deferred by another store.
    """

    def __init__(self, module: nn.Module, label: str = "") -> None:
        self._label = label
        self._module = module
        self._phases = MicrobatchPhases(label)
        self._stash: dict[int, dict[int, list[StashEntry]]] = {}
        # The stash of the micro-batch whose I runs now, filled by _put_stash.
        self._collecting: dict[int, list[StashEntry]] | None = None
        # Bytes of each micro-batch's stash, counted once after its I.
        self._held: dict[int, int] = {}
        # Micro-batches whose I kept no stash: their W rebuilds it first.
        self._dropped: set[int] = set()
        # Micro-batches whose W runs in parts now (backward_weight_in_parts).
        self._in_parts: set[int] = set()
        # True during B: deferred ops add their weight gradients at once.
        self._weights_now = False
        # The order in which micro-batches finished their I in this step.
        self._input_rank: dict[int, int] = {}
        self._input_pass_mb: int | None = None
        self.active_microbatch: int | None = None
        """The micro-batch whose forward (or recomputation during its I) runs now."""
        self._capture: Capture | None = Capture(
            module.named_parameters(), self, self._put_stash, HANDLERS, label
        )
        self._seen_forward = False
        self._marked = self._mark(module)
        for compiled in compiled_modules(module):
            keep_two_stage(compiled)

    def _mark(self, module: nn.Module) -> set[int]:
        """Name this store on every submodule with parameters; refuse one another live
        store defers (modules without parameters, such as a shared rotary embedding,
        may serve several stages)."""
        holders = [(n, m) for n, m in module.named_modules() if m._parameters]
        for name, m in holders:
            owner = m.__dict__.get(_OWNER)
            other = owner() if owner is not None else None
            if other is not None and other is not self and other._defers(m):
                raise TwoStageBackwardError(
                    f"{self._where()}module '{name or type(m).__name__}' is already deferred by "
                    f"another WeightGradStore; call its restore() first"
                )
        for _, m in holders:
            m.__dict__[_OWNER] = weakref.ref(self)
        return {id(m) for _, m in holders}

    def _defers(self, module: nn.Module) -> bool:
        return self._capture is not None and id(module) in self._marked

    def _where(self) -> str:
        return f"{self._label}: " if self._label else ""

    # -- F -------------------------------------------------------------------

    @contextmanager
    def forward(self, mb: int) -> Iterator[None]:
        """Run the forward of micro-batch ``mb`` inside this context.

        Covered operations that read the module's parameters record their
        work for ``mb``, whoever calls them, under ``torch.autocast`` too.
        Under ``torch.no_grad`` nothing is recorded and the module runs as it is.

        Raises:
            TwoStageBackwardError: if another forward (of this store or
                another) is active, or ``mb`` already ran in this step.
        """
        if not torch.is_grad_enabled():
            yield
            return
        if self.active_microbatch is not None:
            raise TwoStageBackwardError(
                f"{self._where()}forward of micro-batch {mb} started inside the forward of "
                f"micro-batch {self.active_microbatch}; run forwards one after another"
            )
        _check_no_other_capture(self._where(), mb)
        self._phases.start_forward(mb)
        self.active_microbatch = mb
        capture = self._capture
        try:
            if capture is None:
                yield
            else:
                token = capture.begin()
                try:
                    yield
                finally:
                    capture.end(token)
        except BaseException:
            self._phases.cancel_forward(mb)
            raise
        finally:
            self.active_microbatch = None
        if capture is not None:
            self._seen_forward = capture.checked = True

    # -- I -------------------------------------------------------------------

    def _ops(self) -> list[DeferredOp]:
        return [] if self._capture is None else self._capture.ops

    def _put_stash(self, mb: int, op_index: int, tensors: tuple[Tensor, ...]) -> None:
        """Called by deferred ops during I: keep what their W needs."""
        collecting = self._collecting
        if collecting is None or self._input_pass_mb != mb:
            name = self._ops()[op_index].name
            during = (
                "outside backward_input"
                if self._input_pass_mb is None
                else f"during backward_input of micro-batch {self._input_pass_mb}"
            )
            raise TwoStageBackwardError(
                f"{self._where()}{name} of micro-batch {mb} ran its backward "
                f"{during}; its weight gradient would be lost. Run the backward of a forward "
                f"made in store.forward({mb}) with store.backward_input({mb}, ...) or "
                f"store.backward_full({mb}, ...)"
            )
        if self._weights_now:
            # B: the weight gradient now, while the op's operands are in cache.
            self._ops()[op_index].accumulate_weight_grads((tensors,), SharedRows())
            return
        entry = StashEntry.of(tensors)
        entries = collecting.get(op_index)
        if entries is None:
            collecting[op_index] = [entry]
        else:
            entries.append(entry)

    def backward_input(
        self,
        mb: int,
        outputs: Sequence[Tensor],
        grad_outputs: Sequence[Tensor | None],
        inputs: Sequence[Tensor],
        keep_stash: bool = True,
    ) -> tuple[Tensor | None, ...]:
        """I: gradients with respect to the stage inputs of micro-batch ``mb``.

        Runs one plain autograd backward from ``outputs``. Deferred ops
        compute only their input gradient and stash what their weight
        gradient needs; every other parameter gets its exact gradient added to
        ``.grad`` now.

        Args:
            mb: the micro-batch.
            outputs: the stage outputs of ``mb`` (those that need no gradient
                are skipped).
            grad_outputs: the gradient of the loss with respect to each output
                (None for a scalar loss).
            inputs: the stage inputs of ``mb``: leaf tensors, e.g. received
                activations made with ``.detach().requires_grad_()``.
            keep_stash: False drops what the deferred ops stash (derivative
                checkpointing): the caller keeps the inputs and output
                gradients instead, and :meth:`backward_weight` rebuilds the
                stash with its ``rebuild`` function.

        Returns:
            For each input, its gradient: None if it does not require one,
            zeros if it requires one but the outputs do not depend on it.

        Raises:
            ValueError: if ``grad_outputs`` does not match ``outputs`` or an
                input that requires a gradient is not a leaf.
            TwoStageBackwardError: if I of ``mb`` already ran in this step.
        """
        grads = self._backward(
            mb, outputs, grad_outputs, inputs, weights_now=False, keep_stash=keep_stash
        )
        if not keep_stash:
            self._dropped.add(mb)
        return grads

    def _backward(
        self,
        mb: int,
        outputs: Sequence[Tensor],
        grad_outputs: Sequence[Tensor | None],
        inputs: Sequence[Tensor],
        weights_now: bool,
        keep_stash: bool = True,
    ) -> tuple[Tensor | None, ...]:
        """The autograd pass of I (``weights_now=False``) or B (``True``)."""
        if len(outputs) != len(grad_outputs):
            raise ValueError(
                f"backward_input of micro-batch {mb}: {len(outputs)} outputs but "
                f"{len(grad_outputs)} grad_outputs"
            )
        for i, x in enumerate(inputs):
            if x.requires_grad and not x.is_leaf:
                raise ValueError(
                    f"backward_input of micro-batch {mb}: input {i} is not a leaf; pass the "
                    f"tensor the stage ran on, made with .detach().requires_grad_()"
                )
        if self.active_microbatch is not None:
            raise TwoStageBackwardError(
                f"{self._where()}backward_input of micro-batch {mb} called while micro-batch "
                f"{self.active_microbatch} is active; leave store.forward(...) first"
            )
        self._phases.check_input(mb)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
        # Read the input gradients from the leaves; keep what they held before.
        previous = [x.grad for x in inputs]
        for x in inputs:
            x.grad = None
        # Active during I too: activation checkpointing re-runs the forward
        # here, and the recomputation must take the same path.
        self._input_pass_mb = self.active_microbatch = mb
        self._weights_now = weights_now
        self._collecting = {} if weights_now or not keep_stash else self._stash.setdefault(mb, {})
        capture = self._capture
        try:
            if pairs:
                if capture is None:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                else:
                    token = capture.begin()
                    try:
                        _run_backward(pairs)
                    finally:
                        capture.end(token)
            grads = tuple(_input_grad(x) for x in inputs)
        finally:
            self._input_pass_mb = self.active_microbatch = self._collecting = None
            self._weights_now = False
            self._held.pop(mb, None)
            for x, g in zip(inputs, previous, strict=True):
                x.grad = g
        self._phases.finish_input(mb)
        self._input_rank[mb] = len(self._input_rank)
        if weights_now:
            self._phases.finish_weight(mb)
        return grads

    # -- W -------------------------------------------------------------------

    def backward_weight(
        self,
        mbs: Iterable[int],
        weight_group_size: int | None = None,
        rebuild: Rebuild | None = None,
        *,
        group_size: int | None = None,
    ) -> None:
        """W: add the weight gradients of micro-batches ``mbs`` to ``.grad``.

        Each deferred op runs one concatenated operation per group (and per
        distinct input shape) instead of one per micro-batch.

        Args:
            mbs: micro-batches whose I is done and W is not, in any order.
            weight_group_size: None runs all of ``mbs`` as one group; ``k``
                splits ``mbs`` into consecutive groups of ``k`` (the
                pipeline's option of the same name).
            rebuild: re-runs the forward of a micro-batch whose I ran with
                ``keep_stash=False``. Its stash is rebuilt by that forward and
                an input pass that adds no gradient anywhere, one group at a
                time, so that only one group's stash is held at once. Without
                ``weight_group_size`` a group closes once its stashes reach
                :data:`~twobp.engine.stash.CONCAT_ROWS` rows (where a larger
                concatenation stops paying).

        Raises:
            ValueError: if ``mbs`` is empty or repeats, or ``weight_group_size < 1``.

        ``group_size=`` is the former name of ``weight_group_size`` (deprecated).
            TwoStageBackwardError: if a micro-batch is unknown, its I has not
                run, its W already ran, a stashed tensor was modified in
                place since its I, or its stash was dropped and no
                ``rebuild`` is given. Nothing is computed then.
        """
        if group_size is not None:
            warnings.warn(
                "backward_weight(group_size=...) is now weight_group_size=",
                DeprecationWarning,
                stacklevel=2,
            )
            weight_group_size = group_size
        group_size = weight_group_size
        group = self._phases.check_weight(mbs)
        if group_size is not None and group_size < 1:
            raise ValueError(f"weight_group_size must be None or >= 1, got {group_size}")
        self._check_stashes(group, rebuild is not None)
        if rebuild is not None and group_size is None:
            self._rebuild_and_weigh(group, rebuild)
            return
        size = len(group) if group_size is None else group_size
        for start in range(0, len(group), size):
            chunk = group[start : start + size]
            if rebuild is not None:
                for mb in chunk:
                    if mb in self._dropped:
                        self._rebuild_stash(mb, rebuild)
            self._weight_pass(chunk)

    def _check_stashes(self, group: Sequence[int], rebuild: bool) -> None:
        """Refuse a W of ``group`` that cannot run now: a micro-batch whose W runs in
        parts, whose stash was dropped (without ``rebuild``) or changed in place."""
        ops = self._ops()
        for mb in group:
            if mb in self._in_parts:
                raise TwoStageBackwardError(
                    f"{self._where()}backward_weight W{mb}: the W of micro-batch {mb} is "
                    "running in parts (backward_weight_in_parts); finish that first"
                )
            if mb in self._dropped and not rebuild:
                raise TwoStageBackwardError(
                    f"{self._where()}backward_weight W{mb}: the backward_input of micro-batch "
                    f"{mb} ran with keep_stash=False; pass rebuild= to re-run its forward"
                )
            for op_index, entries in self._stash.get(mb, {}).items():
                if any(e.changed() for e in entries):
                    raise TwoStageBackwardError(
                        f"{self._where()}a tensor that {ops[op_index].name} "
                        f"stashed for the W of micro-batch {mb} was modified in place after "
                        f"its backward_input; keep inputs and output gradients unchanged until W"
                    )

    def _rebuild_and_weigh(self, group: Sequence[int], rebuild: Rebuild) -> None:
        """W of ``group`` without a cap: rebuild stashes until they reach
        :data:`~twobp.engine.stash.CONCAT_ROWS` rows, where concatenating more
        stops paying, and run W of those before rebuilding the next."""
        chunk: list[int] = []
        rows = 0
        for mb in group:
            if mb in self._dropped:
                self._rebuild_stash(mb, rebuild)
            chunk.append(mb)
            rows += self._stash_rows(mb)
            if rows >= CONCAT_ROWS:
                self._weight_pass(chunk)
                chunk, rows = [], 0
        if chunk:
            self._weight_pass(chunk)

    def _stash_rows(self, mb: int) -> int:
        """Rows of the first stashed operand of ``mb`` (all dims but the last)."""
        for entries in self._stash.get(mb, {}).values():
            return sum(e.tensors[0].numel() // max(1, e.tensors[0].shape[-1]) for e in entries)
        return 0

    def _weight_pass(self, chunk: Sequence[int]) -> None:
        """W of ``chunk``, whose stashes are all there: one concatenated pass per op."""
        for _ in self._weight_layers(chunk):
            pass

    def backward_weight_in_parts(
        self, mbs: Iterable[int], weight_group_size: int | None = None
    ) -> Iterator[None]:
        """W of ``mbs`` as :meth:`backward_weight` computes it, one op at a time.

        Each ``next()`` runs the concatenated weight gradient of one deferred
        op (one layer's linear, say) and pauses before the next, so that a
        caller can stop between two of them and go on later; the iterator ends
        right after the last op, the whole W done. The micro-batches are
        checked at once, as by :meth:`backward_weight`, and refused to any other
        W until this one is done. Micro-batches whose stash was dropped are
        refused: run their W with ``rebuild=`` instead.

        Raises:
            ValueError, TwoStageBackwardError: as :meth:`backward_weight`, at the call.
        """
        group = self._phases.check_weight(mbs)
        if weight_group_size is not None and weight_group_size < 1:
            raise ValueError(f"weight_group_size must be None or >= 1, got {weight_group_size}")
        self._check_stashes(group, rebuild=False)
        self._in_parts.update(group)
        size = len(group) if weight_group_size is None else weight_group_size
        chunks = [group[start : start + size] for start in range(0, len(group), size)]
        return self._parts(chunks)

    def _parts(self, chunks: Sequence[Sequence[int]]) -> Iterator[None]:
        try:
            for index, chunk in enumerate(chunks):
                if index:
                    yield
                yield from self._weight_layers(chunk)
        finally:
            self._in_parts.difference_update(mb for c in chunks for mb in c)

    def _weight_layers(self, chunk: Sequence[int]) -> Iterator[None]:
        """W of ``chunk`` (stashes all there), pausing between two ops' concatenated passes.

        The iterator ends right after the last op. Each op's stash is taken from
        the micro-batches' stashes as it runs, so what is left stays counted by
        :meth:`stashed_bytes` until the chunk is done."""
        # Newest stash first: the last I left part of it in cache.
        newest_first = sorted(chunk, key=lambda m: self._input_rank.get(m, -1), reverse=True)
        shared = SharedRows()
        first = True
        for op in self._ops():
            if not any(op.index in self._stash.get(mb, {}) for mb in newest_first):
                continue
            if not first:
                yield
            first = False
            tensors = [
                e.tensors for mb in newest_first for e in self._stash.get(mb, {}).pop(op.index, ())
            ]
            with torch.no_grad():
                shared.next_layer()
                op.accumulate_weight_grads(tensors, shared)
        for mb in chunk:
            self._stash.pop(mb, None)
            self._held.pop(mb, None)
            self._phases.finish_weight(mb)

    def _rebuild_stash(self, mb: int, rebuild: Rebuild) -> None:
        """Re-run the forward and input pass of ``mb`` to fill its stash, adding no gradient.

        The input pass runs towards the deferred parameters only and returns
        its gradients instead of accumulating them: the stage inputs and the
        parameters that autograd serves got theirs in the I of ``mb``.
        """
        capture = self._capture
        if capture is None:
            self._dropped.discard(mb)
            return
        self.active_microbatch = mb
        token = capture.begin()
        try:
            with torch.enable_grad():
                outputs, grad_outputs = rebuild(mb)
        finally:
            capture.end(token)
            self.active_microbatch = None
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
        targets = _deferred_parameters(self._ops())
        self._input_pass_mb = self.active_microbatch = mb
        self._collecting = self._stash.setdefault(mb, {})
        try:
            if pairs and targets:
                token = capture.begin()
                try:
                    _run_backward(pairs, targets)
                finally:
                    capture.end(token)
        finally:
            self._input_pass_mb = self.active_microbatch = self._collecting = None
        self._dropped.discard(mb)

    def stashed_tensors(self, mb: int) -> list[Tensor]:
        """The tensors kept for the W of ``mb`` now (empty once its W ran or if dropped)."""
        return [t for es in self._stash.get(mb, {}).values() for e in es for t in e.tensors]

    # -- B and the step ------------------------------------------------------

    def backward_full(
        self,
        mb: int,
        outputs: Sequence[Tensor],
        grad_outputs: Sequence[Tensor | None],
        inputs: Sequence[Tensor],
    ) -> tuple[Tensor | None, ...]:
        """B: I and W of micro-batch ``mb`` in one pass (arguments as :meth:`backward_input`).

        Each deferred op adds its weight gradient right after computing its
        input gradient, while the operands are still in cache, and stashes
        nothing. Also valid when the forward of ``mb`` ran outside
        :meth:`forward` (plain autograd): then every gradient comes from the
        autograd pass.

        Raises:
            TwoStageBackwardError: if I or W of ``mb`` already ran in this step.
        """
        return self._backward(mb, outputs, grad_outputs, inputs, weights_now=True)

    def finish_step(self) -> None:
        """End the step: check that every micro-batch is done, then forget them all.

        Raises:
            TwoStageBackwardError: if a micro-batch had F but no I, or I but no
                W. The state and stashes are cleared anyway.
        """
        self._stash.clear()
        self._held.clear()
        self._dropped.clear()
        self._in_parts.clear()
        self._input_rank.clear()
        self._phases.end_step()

    def pending_weight(self) -> tuple[int, ...]:
        """Micro-batches whose I is done and whose W is not, sorted."""
        return self._phases.pending_weight()

    def stashed_bytes(self) -> dict[int, int]:
        """Bytes of tensors kept for W, per micro-batch of this step (0 once its W ran).

        Storages shared by several stashed tensors of a micro-batch are
        counted once. Counted once per micro-batch, after its I.
        """
        held = self._held
        for mb, entries in self._stash.items():
            if mb not in held:
                held[mb] = held_bytes(t for es in entries.values() for e in es for t in e.tensors)
        return {mb: held.get(mb, 0) for mb in self._phases.known()}

    # -- coverage ------------------------------------------------------------

    def routes(self) -> tuple[ParameterRoute, ...]:
        """Every parameter's route and why: as the forwards seen read it, else predicted."""
        if self._seen_forward and self._capture is not None:
            return observed_routes(self._module, self._capture.usage)
        return predicted_routes(self._module)

    def deferred_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every parameter whose gradient W adds (in full or in part)."""
        return [(r.name, r.parameter) for r in self.routes() if r.route is Route.DEFERRED]

    def immediate_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every parameter that autograd accumulates during I."""
        return [(r.name, r.parameter) for r in self.routes() if r.route is Route.IMMEDIATE]

    def report(self) -> str:
        """Which parameters are deferred, which immediate, which frozen, and why.

        Before any forward the routes are predicted from the module types;
        after one, they say which operations read each parameter.
        """
        observed = self._seen_forward and self._capture is not None
        return format_report(self.routes(), self._label, observed)

    def release(self) -> None:
        """Let another store defer the module until :meth:`claim`, keeping what this one learnt.

        For two stores that take turns on one module (two schedules compared
        step by step); call it between steps, and :meth:`claim` before this
        store's next forward.
        """
        for m in self._module.modules():
            owner = m.__dict__.get(_OWNER)
            if owner is not None and owner() is self:
                del m.__dict__[_OWNER]

    def claim(self) -> None:
        """Defer the module again after :meth:`release`.

        Raises:
            TwoStageBackwardError: if another live store defers it now.
        """
        self._marked = self._mark(self._module)

    def restore(self) -> None:
        """Stop deferring: later forwards run as plain autograd, and the module may get a new store.

        Stashed work is dropped; call it between steps.
        """
        self.release()
        self._capture = None
        self._seen_forward = False
        self._stash.clear()
        self._held.clear()
        self._dropped.clear()


def _check_no_other_capture(where: str, mb: int) -> None:
    """Refuse a forward inside the forward of another store."""
    if running_capture() is not None:
        raise TwoStageBackwardError(
            f"{where}forward of micro-batch {mb} started inside the forward of another "
            f"stage's WeightGradStore; run the stages' forwards one after another"
        )


def _run_backward(
    pairs: Sequence[tuple[Tensor, Tensor | None]], towards: Sequence[Tensor] = ()
) -> None:
    """``torch.autograd.backward`` of ``(output, grad)`` pairs, keeping the torch function mode.

    ``torch.autograd.backward`` goes through the active torch function mode,
    which runs it with the mode set aside, and then a forward recomputed by
    activation checkpointing would miss the store's capture. The autograd
    engine, called directly, keeps the mode for the whole pass.

    Args:
        pairs: the outputs and their gradients.
        towards: if given, run only the part of the graph that leads to these
            tensors and accumulate nothing (their gradients are dropped).
    """
    outputs, grads = [], []
    for out, grad in pairs:
        if grad is None:
            if out.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            grad = torch.ones_like(out)
        elif grad.shape != out.shape:
            raise RuntimeError(
                f"Mismatch in shape: grad_output has a shape of {tuple(grad.shape)} and output "
                f"has a shape of {tuple(out.shape)}"
            )
        outputs.append(out)
        grads.append(grad)
    Variable._execution_engine.run_backward(
        tuple(outputs),
        tuple(grads),
        False,
        False,
        tuple(towards),
        allow_unreachable=True,
        accumulate_grad=not towards,
    )


def _deferred_parameters(ops: Sequence[DeferredOp]) -> list[Tensor]:
    """Every parameter a deferred op reads that requires a gradient, each once."""
    seen: dict[int, Tensor] = {}
    for op in ops:
        for operand in op.operands:
            if operand is not None and operand.param.requires_grad:
                seen.setdefault(id(operand.param), operand.param)
    return list(seen.values())


def _input_grad(x: Tensor) -> Tensor | None:
    """The gradient autograd left in leaf ``x`` (zeros if none reached it)."""
    if not x.requires_grad:
        return None
    return x.grad if x.grad is not None else torch.zeros_like(x)


def defer_weight_grads(module: nn.Module, *, label: str = "") -> WeightGradStore:
    """The store that defers the weight gradients of ``module``'s parameters.

    In the forwards run in ``store.forward(mb)``, every covered operation
    whose weight operand is one of the module's parameters defers its weight
    gradient, whoever calls it: ``F.linear``, ``torch.addmm``, ``matmul`` /
    ``@`` / ``mm`` / ``bmm``, ``F.conv1d/2d/3d``, ``F.embedding``,
    ``F.layer_norm``, ``F.rms_norm``, ``F.group_norm``, ``F.batch_norm``, under
    ``torch.autocast`` too. Every other use of a parameter keeps the plain
    autograd path; ``store.report()`` says which is which and why.

    Args:
        module: the stage module.
        label: names the stage in error messages and the report.

    Returns:
        The store that runs I, W and B of this stage.

    Raises:
        TwoStageBackwardError: if a submodule is already deferred by another store.
    """
    return WeightGradStore(module, label=label)
