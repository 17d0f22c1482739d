"""Checks every reference family must pass: block shapes, gradients, presets, meta builds."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from twobp.models import PAPER_SIZES, PRESETS, BlockKind, build_model

FAMILIES = sorted(PRESETS)
PAPER_FAMILIES = sorted(PAPER_SIZES)


def tiny(family, **overrides):
    # Two body blocks are enough to chain blocks and keep the tests fast.
    layers = {"layers": (1, 1)} if family == "resnet" else {"n_layers": 2}
    return build_model(family, "tiny", dtype=torch.float64, **{**layers, **overrides})


@pytest.mark.parametrize("family", FAMILIES)
def test_block_kinds_mark_embedding_first_and_head_last(family):
    spec = tiny(family)
    assert spec.block_kinds[0] is BlockKind.EMBEDDING
    assert spec.block_kinds[-1] is BlockKind.HEAD
    assert set(spec.block_kinds[1:-1]) == {BlockKind.BODY}
    assert len(spec.block_kinds) == spec.n_blocks == len(spec.blocks)


# moe's blocks pass (hidden, aux) tuples: tests/test_models_moe.py runs them block by block.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "moe"])
def test_each_block_runs_forward_and_backward_with_matching_shapes(family):
    spec = tiny(family)
    x = spec.example_input(3)
    for index, block in enumerate(spec.blocks):
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        out = block(x)
        assert isinstance(out, torch.Tensor), f"block {index} returned {type(out)}"
        assert out.dtype == torch.float64
        assert out.shape[0] == 3
        block.zero_grad()
        out.backward(torch.randn_like(out))
        if x.requires_grad:
            assert x.grad is not None and x.grad.shape == x.shape
        for name, p in block.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape, f"block {index} {name}"
        x = out
    assert x.shape[-1] == spec.meta.get("vocab_size", spec.meta.get("num_classes"))


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_loss_is_finite_and_every_parameter_gets_a_gradient(family):
    spec = tiny(family)
    model = spec.sequential()
    x, target = spec.make_batch(4, 0)
    loss = spec.loss_fn(model(x), target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{family}: no gradient reaches {name}"


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_builds_equal_weights_and_data(family):
    a, b = tiny(family, seed=3), tiny(family, seed=3)
    for p, q in zip(a.sequential().parameters(), b.sequential().parameters(), strict=True):
        assert torch.equal(p, q)
    c = tiny(family, seed=4)
    assert any(
        not torch.equal(p, q)
        for p, q in zip(a.sequential().parameters(), c.sequential().parameters(), strict=True)
    )
    assert torch.equal(a.example_input(2, seed=5), b.example_input(2, seed=5))
    assert torch.equal(a.example_target(2, seed=5), a.make_batch(2, 5)[1])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["tiny", "small"])
def test_cpu_presets_build_in_requested_dtype(family, size):
    spec = build_model(family, size, device="meta", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for b in spec.blocks for p in b.parameters())
    assert spec.size == size and spec.family == family


class TensorsMade(TorchFunctionMode):
    """The devices of the tensors that torch functions return while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.devices.add(out.device.type)
        return out


# Published sizes; BERT and Mamba tie the output projection to the word
# embedding, so their published counts hold that matrix once.
PUBLISHED = {"llama": 6.74e9, "bert": 335e6, "mamba": 1.37e9, "resnet": 60.2e6}


@pytest.mark.parametrize("family", PAPER_FAMILIES)
def test_paper_sizes_build_on_meta_with_published_parameter_counts(family):
    with TensorsMade() as made:
        spec = build_model(family, "paper", device="meta")
    # The build allocated nothing: every tensor it made, and every one it kept, is on meta.
    assert made.devices == {"meta"}
    blocks = torch.nn.ModuleList(spec.blocks)
    assert all(t.is_meta for t in (*blocks.parameters(), *blocks.buffers()))
    assert spec.size == PAPER_SIZES[family]
    count = spec.num_parameters(tied_once=True)
    assert count == pytest.approx(PUBLISHED[family], rel=0.02)


def test_paper_block_counts():
    counts = {f: build_model(f, "paper", device="meta").n_blocks for f in PAPER_FAMILIES}
    assert counts == {"bert": 26, "llama": 34, "mamba": 50, "resnet": 52}


def test_untied_heads_add_the_embedding_once_more():
    bert = build_model("bert", "large", device="meta")
    assert bert.num_parameters() - bert.num_parameters(tied_once=True) == 30522 * 1024
    llama = build_model("llama", "tiny", device="meta")
    assert llama.num_parameters() == llama.num_parameters(tied_once=True)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("gpt",), {}, "unknown model family 'gpt'"),
        (("llama", "13b"), {}, "unknown size '13b' of llama"),
        (("bert",), {"n_layer": 2}, "no config field"),
        (("deepspeech", "paper"), {}, "the 2BP paper measures no deepspeech"),
    ],
)
def test_build_model_rejects_unknown_names(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_model(*args, device="meta", **kwargs)
