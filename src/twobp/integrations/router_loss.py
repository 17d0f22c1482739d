"""The load-balancing loss of Hugging Face mixture-of-experts routers, along a pipeline.

A mixture-of-experts causal LM of ``transformers`` (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE) with ``config.output_router_logits`` on adds to its loss
``router_aux_loss_coef`` times its routers' auxiliary loss, ``load_balancing_loss_func``
(Switch Transformer, eq. 4 to 6) over the router logits of every layer at once::

    aux = E * sum over experts e of  f_e * P_e
    f_e = (top-k choices of e) / T        P_e = (routing probabilities of e, summed) / T

where the sums run over the rows (tokens) of every layer with a router, padding left
out, and ``T`` counts those rows. Both sums add up layer by layer, so a pipeline
carries them instead of the logits: for each sample of the batch, ``probs`` (the ``E``
sums of routing probabilities, through which the gradient goes back to every router)
and ``counts`` (the ``E`` counts of top-k choices, without gradient). Each layer block
adds its routers' rows; the loss computes ``aux`` from the last block's sums, with
``T = counts.sum() / top_k``. Float64 routers keep float64 (the model's own rounds
the sums to float32).

A pipeline's loss is the mean of its micro-batches' losses, and ``aux`` is a product
of two means over the tokens, not linear in them: with several micro-batches the
step's ``aux`` is the mean of each micro-batch's own (what the model's loss gives on
each micro-batch), not the model's over the whole batch; with one micro-batch it is
the model's.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

KNOWN = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE"}
"""The ``config.model_type`` of the models whose auxiliary loss this module computes,
by their published names: causal LMs that add ``router_aux_loss_coef`` times
``load_balancing_loss_func`` of their router logits and the attention mask."""

Sums = tuple[Tensor, Tensor]
"""``(probs, counts)``: per sample, the ``E`` sums of routing probabilities and of top-k choices."""


@dataclass(frozen=True)
class RouterLoss:
    """How a model weighs its routers' auxiliary loss, and where its router logits come from."""

    num_experts: int
    """``E``: the experts of every router."""
    top_k: int
    """The experts each token is routed to."""
    coefficient: float
    """The weight of the auxiliary loss in the model's loss (``router_aux_loss_coef``)."""
    router: type[nn.Module]
    """The class of the modules that compute the router logits."""
    index: int
    """Where their output holds the router logits."""

    def routers(self, layer: nn.Module) -> list[nn.Module]:
        """The routers of one layer, in the order they run (none in a dense layer)."""
        return [m for m in layer.modules() if isinstance(m, self.router)]

    @contextlib.contextmanager
    def recorded(self, routers: Sequence[nn.Module]) -> Iterator[list[Tensor]]:
        """The router logits that ``routers`` compute while the context is open, in order."""
        logits: list[Tensor] = []

        def keep(module: nn.Module, args: Any, output: Any) -> None:
            logits.append(output[self.index] if isinstance(output, (tuple, list)) else output)

        handles = [router.register_forward_hook(keep) for router in routers]
        try:
            yield logits
        finally:
            for handle in handles:
                handle.remove()

    def start(self, hidden: Tensor) -> Sums:
        """Zero sums for every sample of ``hidden``: float64 for float64 hidden states,
        float32 otherwise (the model's own sums are float32)."""
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        probs = torch.zeros(hidden.shape[0], self.num_experts, dtype=dtype, device=hidden.device)
        return probs, torch.zeros_like(probs)

    def add(self, sums: Sums, logits: Sequence[Tensor], mask: Tensor | None) -> Sums:
        """``sums`` with the rows of some router logits added.

        Args:
            sums: the sums so far.
            logits: router logits, each ``(samples x positions, E)``.
            mask: the padding mask ``(samples, positions)`` (1 for tokens), or None.
        """
        probs, counts = sums
        samples, experts = probs.shape
        for layer_logits in logits:
            # As load_balancing_loss_func: softmax in the logits' dtype, top-k of it.
            routing = torch.softmax(layer_logits, dim=-1)
            chosen = torch.topk(routing, self.top_k, dim=-1).indices
            picks = nn.functional.one_hot(chosen, experts).sum(dim=-2).to(counts.dtype)
            weights = routing.to(probs.dtype)
            if mask is not None:
                rows = mask.reshape(-1, 1).to(probs.dtype)
                weights, picks = weights * rows, picks * rows
            probs = probs + weights.reshape(samples, -1, experts).sum(dim=1)
            counts = counts + picks.reshape(samples, -1, experts).sum(dim=1)
        return probs, counts

    def loss(self, probs: Tensor, counts: Tensor) -> Tensor:
        """The auxiliary loss of the samples' sums (not yet weighted by :attr:`coefficient`)."""
        rows = counts.sum() / self.top_k
        share = counts.sum(dim=0) / rows
        mean_prob = probs.sum(dim=0) / rows
        return self.num_experts * (share * mean_prob).sum()


def router_loss(model: nn.Module) -> RouterLoss | None:
    """What ``model``'s own loss adds from its routers; None if nothing.

    A model adds an auxiliary loss when its output has an ``aux_loss`` (or its
    configuration a ``router_aux_loss_coef``) and ``config.output_router_logits`` is
    on (or missing).

    Raises:
        ValueError: if the model's loss adds an auxiliary loss that this module cannot
            compute: a model not in :data:`KNOWN`, or one whose router logits it cannot find.
    """
    hf: Any = model
    config = hf.config
    if not _returns_aux_loss(model) or not getattr(config, "output_router_logits", True):
        return None
    name = type(model).__name__
    if getattr(config, "model_type", None) not in KNOWN:
        raise ValueError(
            f"twobp.integrations.transformers cannot add the routers' auxiliary loss "
            f"(aux_loss) of a {name} to the pipeline's loss: it computes that of "
            f"{', '.join(KNOWN.values())}; set model.config.output_router_logits = False "
            "to train without it (the model's own loss then leaves it out too), or write "
            "the loss yourself"
        )
    recorder = _router_recorder(model)
    if recorder is None:
        raise ValueError(
            f"twobp.integrations.transformers cannot find the router logits of a {name} "
            "(its _can_record_outputs['router_logits'] names no router class), so it cannot "
            "add the routers' auxiliary loss (aux_loss) to the pipeline's loss; set "
            "model.config.output_router_logits = False to train without it, or use the "
            "transformers version twobp was checked on (5.x)"
        )
    return RouterLoss(
        num_experts=int(hf.num_experts),
        top_k=int(hf.num_experts_per_tok),
        coefficient=float(hf.router_aux_loss_coef),
        router=recorder[0],
        index=recorder[1],
    )


def _returns_aux_loss(model: nn.Module) -> bool:
    config: Any = getattr(model, "config", None)
    annotation = inspect.signature(type(model).forward).return_annotation
    fields = getattr(annotation, "__dataclass_fields__", None) or {}
    return "aux_loss" in fields or hasattr(config, "router_aux_loss_coef")


def _router_recorder(model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """The router class and the index of the logits in its output, as the model records
    them for its own aux loss: ``_can_record_outputs["router_logits"]``, an
    ``OutputRecorder`` of the router class (transformers 5; checked on 5.25)."""
    recorders = getattr(model, "_can_record_outputs", None) or {}
    spec = recorders.get("router_logits")
    target = getattr(spec, "target_class", None)
    if not isinstance(target, type) or getattr(spec, "layer_name", None) is not None:
        return None
    return target, int(getattr(spec, "index", 0))
