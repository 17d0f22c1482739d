"""Functions the tensor-parallel pipeline tests run on every rank of a launched group."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twobp.models import build_model, tensor_parallel_plan
from twobp.models.common import tie_head
from twobp.runtime import GradScaler, Pipeline
from twobp.runtime.base.tensor_split import split_dims
from twobp.runtime.errors import PipelineConfigError
from twobp.train.engine_summary import rank_summary

LLAMA = {"dim": 16, "n_heads": 4, "ffn_dim": 24, "n_layers": 4, "seq_len": 6, "vocab_size": 32}
STEPS = 3
HEADS = (
    "whole",
    "tied",
    "split",
    "loss_parallel",
    "tied_loss_parallel",
    "smoothed_loss_parallel",
)
"""The embedding and the head: whole on every shard; the head tied to a vocabulary-split
embedding; both split, untied (the head column-parallel with its logits gathered); both split,
the logits left split for the vocabulary-parallel loss, untied or tied, or untied with a
label-smoothed loss."""


def smoothed_lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The LM loss with ``label_smoothing=0.1``."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)


def _llama(head: str, **sizes: Any) -> tuple[Any, dict[str, Any]]:
    """The tiny LLaMA in float64 with its head as ``head`` says, and its plan."""
    spec = build_model("llama", "tiny", dtype=torch.float64, **{**LLAMA, **sizes})
    plan: dict[str, Any] = dict(tensor_parallel_plan("llama"))
    if head == "tied":
        tie_head(spec.blocks[0].embed, spec.blocks[-1].output)
        plan["embed"] = "rowwise"  # the tied head follows
    if head == "split":
        plan.update({"embed": "rowwise", "output": "colwise_gather_output"})
    if head.endswith("loss_parallel"):
        if head.startswith("tied"):
            tie_head(spec.blocks[0].embed, spec.blocks[-1].output)
        plan = tensor_parallel_plan("llama", loss_parallel=True)
    if head.startswith("smoothed"):
        spec = dataclasses.replace(spec, loss_fn=smoothed_lm_loss)
    return spec, plan


def _whole(pipe: Pipeline, param: torch.Tensor, like: nn.Parameter) -> torch.Tensor:
    """``param`` (a gradient or a parameter of this rank) joined over the tensor-parallel group."""
    dim = split_dims(pipe.module).get(id(like))
    if dim is None:
        return param
    group = pipe._tensor.group  # type: ignore[union-attr]
    pieces = [torch.empty_like(param) for _ in range(pipe.tp_size)]
    dist.all_gather(pieces, param.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def parity(
    cases: list[tuple[str, bool | str, int]],
    tensor_parallel: int,
    shard_optimizer: bool = False,
    head: str = "whole",
    compile: bool = False,
    mesh_dims: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """Per case (schedule, two_bp or a 2BP policy, data_parallel): the largest difference
    from one process on the whole model, in float64: the loss of every step, every
    gradient of the first step and every parameter after ``STEPS`` AdamW steps (shards
    joined), and the norm (not with ``shard_optimizer``: AdamW's state sharded over the
    copies, no clipping); the share of weight elements W adds; the seconds in the
    tensor-parallel all-reduces of the backwards and the W parts run meanwhile, summed
    over the steps; ``head`` one of :data:`HEADS`; ``compile``: the stages compiled;
    ``mesh_dims``: the layout given as a ``DeviceMesh`` of these dims (``("dp", "pp",
    "tp")`` or ``("pp", "tp")``) instead of ``data_parallel`` and ``tensor_parallel``."""
    out = []
    for schedule, two_bp, data_parallel in cases:
        spec, plan = _llama(head)
        whole = nn.Sequential(*copy.deepcopy(spec.blocks))
        layout: dict[str, Any] = {
            "data_parallel": data_parallel,
            "tensor_parallel": tensor_parallel,
        }
        if mesh_dims is not None:
            from torch.distributed.device_mesh import init_device_mesh

            pipeline = dist.get_world_size() // data_parallel // tensor_parallel
            sizes = {"dp": data_parallel, "pp": pipeline, "tp": tensor_parallel}
            shape = tuple(sizes[d] for d in mesh_dims)
            layout = {"mesh": init_device_mesh("cpu", shape, mesh_dim_names=mesh_dims)}
        pipe = Pipeline(
            spec.blocks,
            spec.loss_fn,
            schedule,
            n_microbatches=4,
            two_bp=bool(two_bp),
            two_bp_policy=two_bp if isinstance(two_bp, str) else "paper",
            tensor_parallel_plan=plan,
            compile=compile,
            **layout,
        )
        optimizer = (
            pipe.shard_optimizer(torch.optim.AdamW, lr=1e-2)
            if shard_optimizer
            else torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        )
        reference = torch.optim.AdamW(whole.parameters(), lr=1e-2)
        names = dict(whole.named_parameters())
        errors = {"loss": 0.0, "gradients": 0.0, "parameters": 0.0, "norm": 0.0}
        errors.update(reducing=0.0, weights_in_reductions=0.0)
        for step in range(STEPS):
            inputs, targets = spec.make_batch(8 * data_parallel, step)
            if head.endswith("loss_parallel"):
                # Ignored (by the reference too), as many in every micro-batch of 2 rows.
                targets[::2, -2:] = -100
            mine = slice(8 * pipe.dp_rank, 8 * (pipe.dp_rank + 1))
            pipe.zero_grad()
            loss = pipe.step(inputs[mine], targets[mine])
            reference.zero_grad()
            expected = spec.loss_fn(whole(inputs), targets)
            expected.backward()
            errors["loss"] = max(errors["loss"], abs(loss - float(expected.detach())))
            errors["reducing"] += pipe.step_times.reducing
            errors["weights_in_reductions"] += pipe.step_times.weights_in_reductions
            if step == 0 and not shard_optimizer:  # a sharded optimizer holds them apart
                for name, param in pipe.named_parameters():
                    assert param.grad is not None, name
                    grad = _whole(pipe, param.grad, param)
                    ref = names[name].grad
                    assert ref is not None
                    errors["gradients"] = max(errors["gradients"], float((grad - ref).abs().max()))
            if not shard_optimizer:
                norm = pipe.clip_grad_norm_(1e9)
                expected_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), 1e9)
                errors["norm"] = max(errors["norm"], abs(float(norm) - float(expected_norm)))
            optimizer.step()
            reference.step()
        for name, param in pipe.named_parameters():
            joined = _whole(pipe, param.detach(), param)
            errors["parameters"] = max(
                errors["parameters"], float((joined - names[name].detach()).abs().max())
            )
        # Shards at their local size: parameters, their gradients, buffers.
        local = sum(2 * p.numel() * p.element_size() for p in pipe.parameters())
        local += sum(b.numel() * b.element_size() for b in pipe.module.buffers())
        errors["memory"] = 0 if shard_optimizer else pipe.memory_stats()["parameters"] - local
        errors["tp_rank"] = pipe.tp_rank
        errors["tp_size"] = pipe.tp_size
        errors["sharded"] = len(split_dims(pipe.module))
        summary = rank_summary(pipe.stages.values())
        # Of the weights of this rank's split stages (none: its backward is fused).
        errors["deferred"] = summary.deferred / summary.weights if summary.weights else None
        pipe.close()
        out.append(errors)
    return out


def overflow_agreed() -> list[bool]:
    """A GradScaler step where only tensor-parallel rank 1's shard overflows: skipped on
    every rank."""
    spec = build_model("llama", "tiny", dtype=torch.float32, **LLAMA)
    scaler = GradScaler(init_scale=2.0**10)
    pipe = Pipeline(
        spec.blocks,
        spec.loss_fn,
        "1f1b",
        n_microbatches=2,
        tensor_parallel=2,
        tensor_parallel_plan=tensor_parallel_plan("llama"),
        grad_scaler=scaler,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    inputs, targets = spec.make_batch(4, 0)
    pipe.step(inputs, targets)
    if pipe.tp_rank == 1:
        dims = split_dims(pipe.module)
        split = next(p for p in pipe.parameters() if id(p) in dims)
        assert split.grad is not None
        split.grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in pipe.parameters()]
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(b, p) for b, p in zip(before, pipe.parameters(), strict=True))
    pipe.close()
    return [unchanged, scaler.get_scale() < 2.0**10]


def refusal(case: str) -> str:
    """The one-line error of a bad tensor-parallel setup, or 'accepted'."""
    spec = build_model("llama", "tiny", dtype=torch.float64, **LLAMA)
    plan: Any = tensor_parallel_plan("llama")
    kwargs: dict[str, Any] = {"tensor_parallel": 2, "n_microbatches": 2}
    if case == "world":
        kwargs["tensor_parallel"] = 3
    if case == "no module":
        plan = {**plan, "attn.wqkv": "colwise"}
    if case == "heads":
        spec = build_model("llama", "tiny", dtype=torch.float64, **{**LLAMA, "n_heads": 1})
    if case == "vocabulary":
        spec, plan = _llama("tied", vocab_size=33)
    if case == "embedding columns":
        plan = {**plan, "embed": "colwise"}
    if case == "tied two ways":
        spec, plan = _llama("tied")
        plan = {**plan, "embed": "rowwise", "output": "rowwise"}
    if case == "auto":
        kwargs["schedule"] = "auto"
    if case == "sizes differ":
        # rank 1 left it out; a short timeout: waiting for the other's groups fails the test
        kwargs["tensor_parallel"] = 2 if dist.get_rank() == 0 else None
        kwargs["timeout"] = 30
    if case.startswith("mesh"):
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        del kwargs["tensor_parallel"]
        if case == "mesh layout":  # tp outermost
            grid = torch.arange(4).reshape(2, 2).t().contiguous()
            kwargs["mesh"] = DeviceMesh("cpu", grid, mesh_dim_names=("pp", "tp"))
        elif case == "mesh size":
            kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
            kwargs["tensor_parallel"] = 4
        else:  # a mesh of copies with tensor_parallel besides
            kwargs["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
            kwargs["tensor_parallel"] = 2
    if case in ("torch styles", "sequence parallel"):
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
        plan = {pattern: styles[style] for pattern, style in plan.items()}
        if case == "sequence parallel":
            plan["attn_norm"] = SequenceParallel()
    try:
        pipe = Pipeline(
            spec.blocks, spec.loss_fn, tensor_parallel_plan=plan, **{"schedule": "1f1b", **kwargs}
        )
        if case == "checkpoint":
            pipe.state_dict()
        pipe.close()
    except PipelineConfigError as exc:
        return str(exc)
    return "accepted"


def hugging_face(
    schedule: str, tied: bool = False, loss_parallel: bool = False
) -> dict[str, float]:
    """A Hugging Face LLaMA (its head tied to the embedding if ``tied``: on the first and
    the last stage) split by its own plan (the decoders' ``base_model_tp_plan``, the
    embedding by vocabulary, the head by columns, its logits gathered or, with
    ``loss_parallel``, left split for the loss), against the whole model in one process: the
    loss and the parameters after ``STEPS`` AdamW steps (float64)."""
    import transformers

    from twobp.integrations import transformers as hf

    torch.manual_seed(0)
    config = hf.build_model("llama", vocab_size=96).config
    config.tie_word_embeddings = tied
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    whole = copy.deepcopy(model)
    net, loss_fn = hf.blocks(whole), hf.loss_function(whole)
    pipe = Pipeline(
        hf.blocks(model),
        hf.loss_function(model),
        schedule,
        n_microbatches=2,
        tensor_parallel=2,
        tensor_parallel_plan=hf.tensor_parallel_plan(model, loss_parallel=loss_parallel),
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    reference = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    vocab = model.config.vocab_size
    errors = {"loss": 0.0, "parameters": 0.0}
    for step in range(STEPS):
        ids = torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(step))
        pipe.zero_grad()
        loss = pipe.step(ids, ids)
        reference.zero_grad()
        expected = loss_fn(net(ids), ids)
        expected.backward()
        errors["loss"] = max(errors["loss"], abs(loss - float(expected.detach())))
        optimizer.step()
        reference.step()
    names = dict(net.named_parameters())
    for name, param in pipe.named_parameters():
        joined = _whole(pipe, param.detach(), param)
        errors["parameters"] = max(
            errors["parameters"], float((joined - names[name].detach()).abs().max())
        )
    errors["sharded"] = len(split_dims(pipe.module))
    pipe.close()
    return errors


def checkpoint_across(folder: str) -> dict[str, float]:
    """On 4 ranks: 2 AdamW steps at P 2 x T 2, saved; loaded at P 4 without tensor
    parallelism for 2 more steps, saved; loaded at P 2 x T 2 again for 1 more. Returns the
    largest difference of the losses and final parameters from 5 steps of one process. The
    checkpoint saved at P 4 holds whole tensors, as tensor-parallel checkpoints were written
    before each rank wrote its shards: it loads at T 2 as one of those does."""
    spec = build_model("llama", "tiny", dtype=torch.float64, **LLAMA)
    whole = nn.Sequential(*copy.deepcopy(spec.blocks))
    reference = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    expected = []
    for step in range(5):
        inputs, targets = spec.make_batch(8, step)
        reference.zero_grad()
        loss = spec.loss_fn(whole(inputs), targets)
        loss.backward()
        reference.step()
        expected.append(float(loss.detach()))
    errors = {"loss": 0.0, "parameters": 0.0}
    plan = tensor_parallel_plan("llama")
    phases = [(2, 0, 2, None), (1, 2, 4, f"{folder}/a"), (2, 4, 5, f"{folder}/b")]
    for tensor_parallel, first, last, source in phases:
        blocks = build_model("llama", "tiny", dtype=torch.float64, **LLAMA).blocks
        if source is not None:  # other weights than the saved ones: the load must set them
            for block in blocks:
                for p in block.parameters():
                    p.data.normal_()
        pipe = Pipeline(
            blocks,
            spec.loss_fn,
            "1f1b",
            n_microbatches=4,
            tensor_parallel=tensor_parallel,
            tensor_parallel_plan=plan if tensor_parallel > 1 else None,
        )
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        if source is not None:
            pipe.load(source, optimizer)
        for step in range(first, last):
            inputs, targets = spec.make_batch(8, step)
            pipe.zero_grad()
            loss = pipe.step(inputs, targets)
            optimizer.step()
            errors["loss"] = max(errors["loss"], abs(loss - expected[step]))
        if last < 5:
            pipe.save(f"{folder}/{'a' if last == 2 else 'b'}", optimizer)
        else:
            names = dict(whole.named_parameters())
            for name, param in pipe.named_parameters():
                joined = _whole(pipe, param.detach(), param)
                errors["parameters"] = max(
                    errors["parameters"], float((joined - names[name].detach()).abs().max())
                )
        pipe.close()
    return errors
