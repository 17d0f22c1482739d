"""Functions the vocabulary-parallel cross-entropy tests run on every rank of a launched group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twobp.models.tensor_parallel import vocab_parallel_cross_entropy
from twobp.models.vocab_parallel import loss_parallel, mark_shard

VOCAB = 12


def _logits_and_targets(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole logits (3, 4, VOCAB) in float64, large enough that a softmax without its max
    would overflow, and targets with some ignored (-100) and some on every rank's range."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, VOCAB, dtype=torch.float64, generator=gen) * 5 + 800
    targets = torch.randint(0, VOCAB, (3, 4), generator=gen)
    targets[0, :2] = -100
    return logits, targets


def function_errors(
    reduction: str, smoothing: float = 0.0, class_weights: bool = False
) -> dict[str, float]:
    """``vocab_parallel_cross_entropy`` of this rank's columns against ``F.cross_entropy`` of
    the whole logits (``label_smoothing=smoothing`` and, with ``class_weights``, a weight
    per id in [0.5, 1.5) for both): the loss and this rank's columns of the gradient
    (largest difference)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    logits, targets = _logits_and_targets(0)
    per_id = None
    if class_weights:
        per_id = torch.rand(VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        per_id += 0.5
    weight = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    whole = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(
        whole.flatten(0, 1),
        targets.flatten(),
        weight=per_id,
        reduction=reduction,
        label_smoothing=smoothing,
    )
    expected = expected.reshape(3, 4) if reduction == "none" else expected
    (expected * (weight if reduction == "none" else 1.0)).sum().backward()
    shard = logits.chunk(size, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(
        shard, targets, None, reduction=reduction, label_smoothing=smoothing, weight=per_id
    )
    (loss * (weight if reduction == "none" else 1.0)).sum().backward()
    assert whole.grad is not None and shard.grad is not None
    mine = whole.grad.chunk(size, dim=-1)[rank]
    return {
        "loss": float((loss - expected).detach().abs().max()),
        "gradient": float((shard.grad - mine).abs().max()),
        "finite": float(torch.isfinite(loss).all()),
    }


def hugging_face_style_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A loss as Hugging Face writes it: shifted labels, a reshape to the whole vocabulary."""
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    logits = logits.float() if logits.dtype != torch.float64 else logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1).to(logits.device))


def in_loss_parallel(case: str) -> Any:
    """A loss run inside ``loss_parallel`` on this rank's marked columns: its difference from
    the same loss of the whole logits, or the error it raised."""
    size, rank = dist.get_world_size(), dist.get_rank()
    logits, targets = _logits_and_targets(2)
    losses = {
        "hugging face": hugging_face_style_loss,
        "masked rows": lambda z, t: F.cross_entropy(z[t >= 0], t[t >= 0]),
        "softmax": lambda z, t: -(z.log_softmax(-1)[..., 0]).mean(),
        # Logits changed outside the loss (in the head's block) lose their mark.
        "unmarked": lambda z, t: F.cross_entropy(torch.zeros(12, VOCAB // 2), t.flatten()),
        "three dims": lambda z, t: F.cross_entropy(z, t),
        "smoothing": lambda z, t: F.cross_entropy(
            z.flatten(0, 1), t.flatten(), label_smoothing=0.1
        ),
        "class weights": lambda z, t: F.cross_entropy(
            z.flatten(0, 1), t.flatten(), weight=torch.linspace(0.5, 1.5, VOCAB, dtype=z.dtype)
        ),
        "weights of a part": lambda z, t: F.cross_entropy(
            z.flatten(0, 1), t.flatten(), weight=torch.ones(VOCAB // 2, dtype=z.dtype)
        ),
        "deprecated reduce": lambda z, t: F.cross_entropy(
            z.flatten(0, 1), t.flatten(), reduce=True
        ),
        "vocabulary flattened": lambda z, t: F.cross_entropy(z.reshape(-1, 3), t.flatten()),
    }
    loss_fn = losses[case]
    shard = mark_shard(logits.chunk(size, dim=-1)[rank].clone(), VOCAB, None)
    try:
        with loss_parallel():
            loss = loss_fn(shard, targets)
    except ValueError as exc:
        return str(exc)
    return float((loss - loss_fn(logits, targets)).abs())


def vocabulary_tensors(head: str, vocab: int = 40) -> dict[str, int]:
    """One training step of the tiny LLaMA on 2 tensor-parallel ranks, its head ``"split"``
    (logits gathered) or ``"loss_parallel"``: the largest tensor any operation of the step
    made whose last dim is the whole vocabulary, and the largest whose last dim is this
    rank's part of it, in bytes (0: none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tensor_parallel_pipeline_workers import _llama
    from twobp.runtime import Pipeline

    spec, plan = _llama(head, vocab_size=vocab)
    pipe = Pipeline(
        spec.blocks,
        spec.loss_fn,
        "1f1b",
        n_microbatches=2,
        tensor_parallel=2,
        tensor_parallel_plan=plan,
    )
    largest = {"whole": 0, "part": 0}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2:
                    key = {vocab: "whole", vocab // 2: "part"}.get(t.shape[-1])
                    if key is not None:
                        largest[key] = max(largest[key], t.numel() * t.element_size())
            return out

    inputs, targets = spec.make_batch(4, 0)
    with Record():
        pipe.step(inputs, targets)
    pipe.close()
    return largest


def pipeline_refusal(case: str) -> str:
    """The one-line error of a loss-parallel head misused in a pipeline, or 'accepted'."""
    from tensor_parallel_pipeline_workers import _llama
    from twobp.runtime import Pipeline
    from twobp.runtime.errors import PipelineConfigError

    spec, plan = _llama("loss_parallel")
    loss_fn = spec.loss_fn
    if case == "not cross-entropy":
        loss_fn = lambda logits, target: logits.float().pow(2).mean()  # noqa: E731
    if case == "no cross-entropy":
        loss_fn = lambda logits, target: torch.zeros((), requires_grad=True)  # noqa: E731
    if case == "early head":
        plan = {**plan, "attn.wq": "colwise_loss_parallel"}
    try:
        pipe = Pipeline(
            spec.blocks,
            loss_fn,
            "1f1b",
            n_microbatches=2,
            tensor_parallel=2,
            tensor_parallel_plan=plan,
        )
        inputs, targets = spec.make_batch(4, 0)
        pipe.step(inputs, targets)
        pipe.close()
    except (PipelineConfigError, ValueError, RuntimeError) as exc:
        return str(exc)
    return "accepted"
