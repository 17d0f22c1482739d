"""What the compiled-pipeline tests run on every rank of one launched group.

Each case trains the same small model twice, with ``compile`` set and as it is
(eager), and returns both runs' gradients and losses, the dynamo frames
compiled after the third step and at the end, the graph breaks, and where
each stage's parameters got their gradients (the stores' routes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.runtime import Pipeline

DIM = 8
N_BLOCKS = 4
N_MB = 4
STEPS = 5


class Block(nn.Module):
    """Pre-norm residual MLP; a gate read elementwise (left to autograd), a weight
    read through its transpose (deferred as a matmul) and an RMS norm after the
    residual add (compiled unfolded: its normalisation with the add)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Parameter(torch.randn(DIM, 2 * DIM) / 4)
        self.gate = nn.Parameter(torch.ones(DIM))
        self.out_norm = nn.RMSNorm(DIM)
        with torch.no_grad():
            self.out_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.up(self.norm(x)))
        return self.out_norm(x + (h @ self.down.t()) * self.gate)


def blocks(compiled_by_user: bool = False) -> list[nn.Module]:
    """The model, the same on every rank; compiled by ``torch.compile`` if asked."""
    torch.manual_seed(0)
    made: list[nn.Module] = [Block() for _ in range(N_BLOCKS)]
    if compiled_by_user:
        made = [torch.compile(b, backend="aot_eager") for b in made]
    return made


def _train(options: dict[str, Any], compiled_by_user: bool = False) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    frames_before = counters["stats"]["unique_graphs"]
    breaks_before = sum(counters["graph_break"].values())
    pipe = Pipeline(
        blocks(compiled_by_user), F.mse_loss, schedule="1f1b", n_microbatches=N_MB, **options
    )
    losses, frames = [], []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(2 * N_MB, DIM, generator=gen)
        y = torch.randn(2 * N_MB, DIM, generator=gen)
        pipe.zero_grad()
        losses.append(float(pipe.step(x, y)))
        frames.append(counters["stats"]["unique_graphs"] - frames_before)
    routes = {
        s: {r.name.replace("_orig_mod.", ""): r.route.value for r in stage.gradients.routes()}
        for s, stage in pipe.stages.items()
        if hasattr(stage.gradients, "routes")
    }
    grads = {
        n.replace("_orig_mod.", ""): p.grad.clone()
        for n, p in pipe.module.named_parameters()
        if p.grad is not None
    }
    pipe.close()
    return {
        "losses": losses,
        "grads": grads,
        "frames": frames,
        "breaks": sum(counters["graph_break"].values()) - breaks_before,
        "routes": routes,
    }


def compiled_cases(cases: list[tuple[str, dict[str, Any], bool]]) -> dict[str, Any]:
    """Every case compiled and eager: ``(name, Pipeline options, blocks compiled by the user)``."""
    import torch._dynamo

    # The cases' compiled variants of the one block class add up past dynamo's recompile
    # limit (8 per code object), beyond which it would run the frames uncompiled.
    torch._dynamo.config.recompile_limit = 64

    out = {}
    for name, options, by_user in cases:
        eager = {k: v for k, v in options.items() if k != "compile"}
        out[name] = (_train(options, by_user), _train(eager))
    return out


class VirtualClock:
    """The step clock of :func:`trial_choices`: it stands still but where a slow block
    moves it on, so that each way's step times are exactly what the slow blocks add."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


CLOCK = VirtualClock()

SLOW_CALL = 1.0
"""Seconds on :data:`CLOCK` of each call of a slow block or compiled graph (a whole number,
so that the sums are exact)."""


class SlowEagerBlock(Block):
    """A Block whose eager forward takes :data:`SLOW_CALL` on :data:`CLOCK`: compiled (dynamo
    traces it compiling, its graph runs without it), it takes none."""

    def forward(self, x: Tensor) -> Tensor:
        if not torch.compiler.is_compiling():
            CLOCK.now += SLOW_CALL
        return super().forward(x)


def slow_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A dynamo backend whose compiled graphs take :data:`SLOW_CALL` on :data:`CLOCK`."""

    def run(*args: Any) -> Any:
        CLOCK.now += SLOW_CALL
        return gm.forward(*args)

    return run


def trial_choices(slow: str) -> dict[str, Any]:
    """``compile=True``'s choice per stage when eager (``slow="eager"``) or compiled
    (``slow="compiled"``) blocks are the slow ones, and the gradients of the step after
    the trial beside eager's.

    The steps are timed on :data:`CLOCK` (the step clock reads it instead of
    ``time.perf_counter``): only the slow way's steps take time, the same in each step,
    whatever else runs on the machine."""
    import torch._dynamo

    from twobp.runtime.execution import clock

    torch._dynamo.config.recompile_limit = 64
    options: dict[str, Any] = {"regions": "compiled"}
    if slow == "compiled":
        options["backend"] = slow_backend
    else:
        options["backend"] = "aot_eager"

    def model() -> list[nn.Module]:
        torch.manual_seed(0)
        return [SlowEagerBlock() if slow == "eager" else Block() for _ in range(N_BLOCKS)]

    real_time, clock.time = clock.time, CLOCK  # type: ignore[assignment]
    try:
        return _trial_choices(model, options)
    finally:
        clock.time = real_time


def _trial_choices(model: Callable[[], list[nn.Module]], options: dict[str, Any]) -> dict[str, Any]:
    pipes = {
        name: Pipeline(model(), F.mse_loss, schedule="1f1b", n_microbatches=N_MB, compile=compile_)
        for name, compile_ in (("trial", options), ("eager", False))
    }
    from twobp.runtime.setup.compile_trial import TRIALS, WARMUP

    choices = []
    for step in range(WARMUP + 2 * TRIALS + 1):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(2 * N_MB, DIM, generator=gen)
        y = torch.randn(2 * N_MB, DIM, generator=gen)
        for pipe in pipes.values():
            pipe.zero_grad()
            pipe.step(x, y)
        choices.append(pipes["trial"].compile_choice)
    grads = {
        name: {n: p.grad.clone() for n, p in pipe.module.named_parameters() if p.grad is not None}
        for name, pipe in pipes.items()
    }
    trial = pipes["trial"]._parts.compile_trial
    assert trial is not None
    out = {"choices": choices, "grads": grads, "times": trial.times}
    for pipe in pipes.values():
        pipe.close()
    return out


def uncompiled_warnings(
    store: Any, module: nn.Module, rows: list[int], dim: int
) -> list[list[str]]:
    """One micro-batch's F, I and W through ``store`` for each batch size in ``rows``, with
    dynamo's recompile limit at 1 (the sizes after the first run uncompiled): the "ran
    uncompiled" warnings of each."""
    import warnings

    seen = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in rows:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with store.forward(0):
                    out = module(torch.randn(n, dim))
            seen.append([str(w.message) for w in caught if "ran uncompiled" in str(w.message)])
            store.backward_input(0, [out], [torch.ones_like(out)], [])
            store.backward_weight([0])
            store.finish_step()
    return seen
