"""The memory meter: storages counted once, per heading and together, and their peaks."""

from __future__ import annotations

from typing import Any

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


def test_a_parameter_freed_in_the_step_no_longer_hides_what_takes_its_address():
    # Sharded weights are freed within the step: a tensor the allocator puts at their
    # address is another storage under the same key, and counts.
    layer = nn.Linear(16, 16)
    meter = MemoryMeter(torch.device("cpu"))
    meter.start_step([layer])
    key = next(iter(storages([layer.weight])))
    meter.hold(ACTIVATIONS, 0, {key: 64})
    assert meter.held == 0  # the weight itself: left out
    layer.weight.untyped_storage().resize_(0)
    meter.hold(ACTIVATIONS, 1, {key: 64})  # a new storage at the freed address
    assert meter.held == 64


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


def _watched_gpipe() -> tuple[Any, list[int]]:
    """A one-process GPipe pipeline of 4 micro-batches, and the count of forwards its
    meter watched with the saved-tensor hook, kept up to date."""
    from twobp.runtime import Pipeline

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(2)]
    pipe = Pipeline(blocks, nn.functional.mse_loss, schedule="gpipe", n_microbatches=4)
    meter = next(iter(pipe.stages.values())).memory
    watched = [0]
    watch = meter.saved

    def counted(found):
        watched[0] += 1
        return watch(found)

    meter.saved = counted
    return pipe, watched


def test_the_meter_watches_a_forward_once_for_all_steps_of_the_same_shapes():
    # The hook costs a Python call per saved tensor: it runs once, not once per step.
    pipe, watched = _watched_gpipe()
    figures = []
    for _ in range(3):
        pipe.step(torch.randn(8, 16), torch.randn(8, 16))
        figures.append(pipe.memory_stats()["activations"])
    assert watched[0] == 1
    assert figures[0] > 0 and figures == [figures[0]] * 3


def test_the_meter_watches_again_when_the_shapes_or_the_trained_parameters_change():
    pipe, watched = _watched_gpipe()
    pipe.step(torch.randn(8, 16), torch.randn(8, 16))
    full = pipe.memory_stats()["activations"]
    pipe.step(torch.randn(16, 16), torch.randn(16, 16))  # micro-batches twice as large
    assert watched[0] == 2
    assert pipe.memory_stats()["activations"] == 2 * full
    # A frozen first block builds no graph: its forward saves nothing.
    next(iter(pipe.stages.values())).module[0].requires_grad_(False)
    pipe.step(torch.randn(8, 16), torch.randn(8, 16))
    assert watched[0] == 3
    assert pipe.memory_stats()["activations"] < full
