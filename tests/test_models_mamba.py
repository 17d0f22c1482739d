"""Mamba-like model: the selective scan against a naive recurrence, causality."""

import torch

from twobp.models import build_model, selective_scan


def naive_scan(x, delta, a, b, c, d):
    # One scalar recurrence per (batch, channel, state) element.
    batch, seq, channels = x.shape
    y = torch.zeros_like(x)
    for i in range(batch):
        for ch in range(channels):
            h = torch.zeros(a.shape[1], dtype=x.dtype)
            for t in range(seq):
                h = torch.exp(delta[i, t, ch] * a[ch]) * h + delta[i, t, ch] * b[i, t] * x[i, t, ch]
                y[i, t, ch] = (c[i, t] * h).sum() + d[ch] * x[i, t, ch]
    return y


def test_selective_scan_matches_naive_recurrence():
    gen = torch.Generator().manual_seed(0)
    batch, seq, channels, state = 2, 7, 3, 4

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, b, c, d = (
        rand(batch, seq, channels),
        rand(batch, seq, state),
        rand(batch, seq, state),
        rand(channels),
    )
    delta = torch.nn.functional.softplus(rand(batch, seq, channels))
    a = -torch.exp(rand(channels, state))
    torch.testing.assert_close(
        selective_scan(x, delta, a, b, c, d), naive_scan(x, delta, a, b, c, d)
    )


def test_selective_scan_gradients_match_naive_recurrence():
    gen = torch.Generator().manual_seed(1)
    shapes = {
        "x": (1, 5, 2),
        "delta": (1, 5, 2),
        "a": (2, 3),
        "b": (1, 5, 3),
        "c": (1, 5, 3),
        "d": (2,),
    }
    args = {k: torch.randn(*s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}
    args["delta"] = args["delta"].exp()
    args["a"] = -args["a"].exp()
    leaves = {k: v.requires_grad_(True) for k, v in args.items()}
    fast = torch.autograd.grad(selective_scan(**leaves).sum(), list(leaves.values()))
    slow = torch.autograd.grad(naive_scan(**leaves).sum(), list(leaves.values()))
    for f, s in zip(fast, slow, strict=True):
        torch.testing.assert_close(f, s)


def test_outputs_at_a_position_ignore_later_tokens():
    spec = build_model("mamba", "tiny", dtype=torch.float64, n_layers=2)
    model = spec.sequential()
    ids = spec.example_input(2)
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % spec.meta["vocab_size"]
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_step_sizes_start_in_mamba_range():
    spec = build_model("mamba", "tiny", n_layers=1)
    mixer = spec.blocks[1].mixer
    dt = torch.nn.functional.softplus(mixer.dt_proj.bias)
    assert dt.min() >= 1e-4 and dt.max() <= 0.1 + 1e-6
    torch.testing.assert_close(-torch.exp(mixer.A_log[0]), -torch.arange(1.0, 9.0))
