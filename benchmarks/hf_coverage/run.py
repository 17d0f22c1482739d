"""How much of a Hugging Face model's weight gradient 2BP defers, and how close it is.

Each family (LLaMA, GPT-2, BERT masked LM, Mamba) is built from a small
configuration (``twobp.integrations.transformers.build_model``), cut into blocks,
and trained one step as a pipeline would on one process: one store per block,
the forwards of every micro-batch, their input passes, one weight pass over
all. Printed per family, in float32 and under bf16 autocast: the share of
weight elements whose gradient W adds in full, and the largest gradient error
against the model's own backward (per parameter, relative to the larger of its
norm and 1e-3 of the whole gradient's). Needs ``transformers``; one thread.

    python benchmarks/hf_coverage/run.py [--size tiny|small] [--microbatches 2]
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from torch import Tensor, nn

from twobp.engine import WeightGradStore, defer_weight_grads
from twobp.engine.coverage import Route, deferred_share
from twobp.integrations.transformers import FAMILIES, SIZES, blocks, build_model, loss_function


def _leaf(x: Any, first: bool) -> Any:
    if first:
        return x
    if isinstance(x, tuple):
        return (x[0].detach().requires_grad_(), x[1])
    return x.detach().requires_grad_()


def _hidden(x: Any) -> Tensor:
    return x[0] if isinstance(x, tuple) else x


def two_bp_step(
    model: nn.Module, batches: list[tuple[Tensor, Tensor]], dtype: torch.dtype | None
) -> list[WeightGradStore]:
    """F of every micro-batch through every block, then I in reverse, then one W per block."""
    parts = blocks(model)
    stores = [defer_weight_grads(b, label=f"block {i}") for i, b in enumerate(parts)]
    loss_fn = loss_function(model)
    cast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    ran: dict[int, list[tuple[Any, Tensor]]] = {}
    for mb, (ids, labels) in enumerate(batches):
        x: Any = ids
        ran[mb] = []
        for i, (block, store) in enumerate(zip(parts, stores, strict=True)):
            leaf = _leaf(x, i == 0)
            with cast, store.forward(mb):
                y = block(leaf)
                out = loss_fn(y, labels) / len(batches) if i == len(parts) - 1 else _hidden(y)
            ran[mb].append((leaf, out))
            x = y
    for mb in reversed(range(len(batches))):
        grad = None
        for i in reversed(range(len(parts))):
            leaf, out = ran[mb][i]
            inputs = [] if i == 0 else [_hidden(leaf)]
            got = stores[i].backward_input(mb, [out], [grad], inputs)
            grad = got[0] if inputs else None
    for store in stores:
        store.backward_weight(range(len(batches)))
        store.finish_step()
    return stores


def worst_error(model: nn.Module, reference: nn.Module) -> float:
    total = torch.cat([q.grad.double().flatten() for q in reference.parameters()]).norm()
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        diff = (p.grad.double() - q.grad.double()).norm()
        worst = max(worst, float(diff / max(q.grad.double().norm(), 1e-3 * total)))
    return worst


def measure(kind: str, size: str, n: int, dtype: torch.dtype | None) -> tuple[float, float, str]:
    torch.manual_seed(0)
    model = build_model(kind, size)
    reference = copy.deepcopy(model)
    vocab = SIZES[size]["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 32), generator=gen)
        batches.append((ids, ids))
    stores = two_bp_step(model, batches, dtype)
    cast = torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    for ids, labels in batches:
        with cast:
            loss = reference(input_ids=ids, labels=labels).loss
        (loss / n).backward()
    routes = {}
    for store in stores:
        for route in store.routes():
            kept = routes.get(id(route.parameter))
            if kept is None or kept.route is not Route.DEFERRED:
                routes[id(route.parameter)] = route
    immediate = sorted(
        {".".join(r.name.split(".")[-2:]) for r in routes.values() if r.route is Route.IMMEDIATE}
    )
    return (
        deferred_share(tuple(routes.values())),
        worst_error(model, reference),
        ", ".join(immediate),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--microbatches", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"size {args.size} ({SIZES[args.size]}), {args.microbatches} micro-batches of 2 x 32")
    print(
        "| family | float32: deferred | max grad error | bf16 autocast: deferred "
        "| max grad error | immediate (by name) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for kind in FAMILIES:
        share32, error32, immediate = measure(kind, args.size, args.microbatches, None)
        share16, error16, _ = measure(kind, args.size, args.microbatches, torch.bfloat16)
        print(
            f"| {kind} | {share32:.4f} | {error32:.1e} | {share16:.4f} | {error16:.1e} "
            f"| {immediate or '-'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
