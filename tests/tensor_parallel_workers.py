"""Functions the tensor-parallel block tests run on every rank of a launched group."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from twobp.models import LlamaConfig, llama_blocks, shard_block, tensor_parallel_plan

CONFIG = LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, ffn_dim=24, seq_len=6)


def block_errors() -> dict[str, float]:
    """Largest difference of a sharded LLaMA block from the whole one: output, every gradient."""
    torch.manual_seed(1)
    full = llama_blocks(CONFIG, dtype=torch.float64)[1]
    x = torch.randn(2, CONFIG.seq_len, CONFIG.dim, dtype=torch.float64)
    weight = torch.randn(2, CONFIG.seq_len, CONFIG.dim, dtype=torch.float64)
    plan = tensor_parallel_plan("llama")
    sharded = shard_block(copy.deepcopy(full), plan)
    errors = {}
    for name, block in (("full", full), ("sharded", sharded)):
        x_in = x.clone().requires_grad_(True)
        out = block(x_in)
        (out * weight).sum().backward()
        errors[name] = out.detach()
        errors[name + ".input"] = x_in.grad
    result = {
        "output": float((errors["full"] - errors["sharded"]).abs().max()),
        "input": float((errors["full.input"] - errors["sharded.input"]).abs().max()),
    }
    size = dist.get_world_size()
    for (name, part), whole in zip(sharded.named_parameters(), full.parameters(), strict=True):
        grad = part.grad
        assert grad is not None
        if part.shape != whole.shape:
            dim = 0 if plan[name.rsplit(".", 1)[0]] == "colwise" else 1
            pieces = [torch.empty_like(grad) for _ in range(size)]
            dist.all_gather(pieces, grad.contiguous())
            grad = torch.cat(pieces, dim=dim)
        assert whole.grad is not None
        result[name] = float((grad - whole.grad).abs().max())
    return result


def refusal(case: str) -> str:
    """The one-line error of a bad plan or a shape that does not divide by the group."""
    odd = LlamaConfig(vocab_size=32, dim=18, n_layers=1, n_heads=3, ffn_dim=24, seq_len=6)
    config = odd if case == "heads" else CONFIG
    block = llama_blocks(config, dtype=torch.float64)[1]
    plan = tensor_parallel_plan("llama")
    if case == "no module":
        plan["attn.wqkv"] = "colwise"
    if case == "width":
        block.mlp.w2 = torch.nn.Linear(25, CONFIG.dim, bias=False)
    try:
        shard_block(block, plan)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def deferred_errors() -> dict[str, float]:
    """A sharded block under the 2-stage backward: I for 2 micro-batches, then one W.

    Returns the largest gradient difference from autograd on the whole block, the share
    of parameter elements whose gradient W adds, and whether the sharded weights still
    had no gradient between I and W.
    """
    from twobp.engine import defer_weight_grads
    from twobp.engine.coverage import deferred_share

    torch.manual_seed(1)
    full = llama_blocks(CONFIG, dtype=torch.float64)[1]
    sharded = shard_block(copy.deepcopy(full), tensor_parallel_plan("llama"))
    xs = [torch.randn(2, CONFIG.seq_len, CONFIG.dim, dtype=torch.float64) for _ in range(2)]
    weights = [torch.randn_like(x) for x in xs]
    for x, weight in zip(xs, weights, strict=True):
        (full(x) * weight).sum().backward()
    store = defer_weight_grads(sharded)
    for mb, (x, weight) in enumerate(zip(xs, weights, strict=True)):
        x_in = x.clone().requires_grad_(True)
        with store.forward(mb):
            out = sharded(x_in)
        store.backward_input(mb, [out], [weight], [x_in])
    held_back = all(p.grad is None for n, p in sharded.named_parameters() if ".w" in n)
    store.backward_weight([0, 1])
    store.finish_step()
    result = {"share": deferred_share(store.routes()), "held back": float(held_back)}
    size, worst = dist.get_world_size(), 0.0
    for (name, part), whole in zip(sharded.named_parameters(), full.parameters(), strict=True):
        grad = part.grad
        assert grad is not None and whole.grad is not None, name
        if part.shape != whole.shape:
            dim = 0 if part.shape[0] != whole.shape[0] else 1
            pieces = [torch.empty_like(grad) for _ in range(size)]
            dist.all_gather(pieces, grad.contiguous())
            grad = torch.cat(pieces, dim=dim)
        worst = max(worst, float((grad - whole.grad).abs().max()))
    result["gradients"] = worst
    return result


def hugging_face_errors() -> float:
    """Largest difference of a Hugging Face LLaMA layer split by its own plan from the whole."""
    from twobp.integrations import transformers as hf

    torch.manual_seed(0)
    model = hf.build_model("llama").to(torch.float64)
    full = hf.blocks(model)[1]
    sharded = shard_block(copy.deepcopy(full), hf.tensor_parallel_plan(model, vocabulary=False))
    x = torch.randn(2, 6, model.config.hidden_size, dtype=torch.float64)
    outs, grads = [], []
    for block in (full, sharded):
        x_in = x.clone().requires_grad_(True)
        out = block(x_in)
        (out * torch.ones_like(out)).sum().backward()
        outs.append(out.detach())
        grads.append(x_in.grad)
    worst = float(max((outs[0] - outs[1]).abs().max(), (grads[0] - grads[1]).abs().max()))
    for part, whole in zip(sharded.parameters(), full.parameters(), strict=True):
        assert part.grad is not None and whole.grad is not None
        grad = part.grad
        if part.shape != whole.shape:
            pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
            dist.all_gather(pieces, grad.contiguous())
            grad = torch.cat(pieces, dim=0 if part.shape[0] != whole.shape[0] else 1)
        worst = max(worst, float((grad - whole.grad).abs().max()))
    return worst


def _input_reductions(out: torch.Tensor) -> int:
    """The all-reduces of input gradients in ``out``'s backward (its graph's copies)."""
    seen, todo, count = set(), [out.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == "_CopyToGroupBackward"
        todo.extend(next_node for next_node, _ in node.next_functions)
    return count


def input_reductions() -> dict[str, int]:
    """All-reduces of input gradients in one sharded block's backward: the reference
    LLaMA block's, a Hugging Face LLaMA layer's (if transformers is there)."""
    torch.manual_seed(1)
    block = shard_block(llama_blocks(CONFIG)[1], tensor_parallel_plan("llama"))
    x = torch.randn(2, CONFIG.seq_len, CONFIG.dim, requires_grad=True)
    counts = {"llama": _input_reductions(block(x))}
    try:
        from twobp.integrations import transformers as hf

        model = hf.build_model("llama")
    except ImportError:
        return counts
    layer = shard_block(hf.blocks(model)[1], hf.tensor_parallel_plan(model, vocabulary=False))
    x = torch.randn(2, 6, model.config.hidden_size, requires_grad=True)
    counts["hugging face"] = _input_reductions(layer(x))
    return counts
