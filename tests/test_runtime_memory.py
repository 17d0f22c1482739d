"""The memory meter: storages counted once, per heading and together, and their peaks."""

from __future__ import annotations

import torch
from torch import nn

from twobp.runtime.execution.memory import ACTIVATIONS, STASH, MemoryMeter, memory_stats, storages


def test_views_of_one_storage_count_once():
    batch = torch.zeros(8, 4, dtype=torch.float64)
    parts = batch.chunk(4)
    assert sum(storages(parts).values()) == batch.nbytes
    assert storages([None, 3, batch]) == storages([batch])


def test_a_storage_held_under_two_keys_counts_once_until_both_release():
    meter = MemoryMeter(torch.device("cpu"))
    meter.start_step([])
    shared, own = torch.zeros(100), torch.zeros(50)
    meter.hold(ACTIVATIONS, 0, storages([shared, own]))
    meter.hold(ACTIVATIONS, 1, storages([shared[:10]]))
    meter.hold(STASH, 0, storages([shared]))
    meter.sample()
    assert meter.peaks[ACTIVATIONS] == 600 and meter.peaks[STASH] == 400
    assert meter.peaks[""] == 600  # the shared storage once over both headings
    meter.release(ACTIVATIONS, 0)
    meter.release(STASH, 0)
    meter.sample({("cpu", torch.zeros(25).untyped_storage().data_ptr()): 100})
    assert meter.peaks[""] == 600
    meter.release(ACTIVATIONS, 1)
    meter.start_step([])
    assert meter.peaks == {ACTIVATIONS: 0, STASH: 0, "": 0}


def test_saved_tensors_are_seen_and_parameters_left_out():
    layer = nn.Linear(16, 16)
    meter = MemoryMeter(torch.device("cpu"))
    meter.start_step([layer])
    found: dict = {}
    x = torch.randn(4, 16, requires_grad=True)
    with meter.saved(found):
        y = torch.tanh(layer(x))
    assert sum(found.values()) == x.nbytes + y.nbytes  # the input and tanh's output
    y.sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


def test_memory_stats_counts_parameters_gradients_and_the_optimizer_state():
    layer = nn.Linear(16, 16)
    layer(torch.randn(2, 16)).sum().backward()
    optimizer = torch.optim.Adam(layer.parameters())
    optimizer.step()
    meter = MemoryMeter(torch.device("cpu"))
    stats = memory_stats(meter, layer, optimizer)
    params = sum(p.nbytes for p in layer.parameters())
    assert stats["parameters"] == 2 * params
    steps = sum(s["step"].nbytes for s in optimizer.state.values())
    assert stats["optimizer"] == 2 * params + steps
    assert stats["peak"] == stats["parameters"] + stats["optimizer"]


def _activations_of_gpipe(m: int) -> int:
    from twobp.runtime import Pipeline

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(2)]
    pipe = Pipeline(blocks, nn.functional.mse_loss, schedule="gpipe", n_microbatches=m)
    for _ in range(2):  # the second step starts from a fresh meter
        pipe.step(torch.randn(2 * m, 16), torch.randn(2 * m, 16))
    return pipe.memory_stats()["activations"]


def test_every_microbatch_counts_what_the_watched_forward_saved():
    # GPipe holds every micro-batch's activations at once. Only the first
    # forward of the step is watched; the others must count as much.
    one = _activations_of_gpipe(1)
    assert one > 0
    assert _activations_of_gpipe(4) == 4 * one
