"""What the tests of tensor parallelism with sharded parameters run on every rank."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tensor_parallel_pipeline_workers import _llama
from twobp.runtime import Pipeline

STEPS = 4
CLIP = 1e-3
"""The global norm the steps clip to (below the model's, so that every step clips)."""


def losses_against_one_process(schedules: list[str]) -> dict[str, Any]:
    """Per schedule: the largest difference of each step's loss and clipped global norm
    from one process on the whole model (float64, AdamW on shards), and the bytes of
    parameters, gradients and optimizer state this rank holds after a step, sharded and
    not, and ``whole``: those of its tensor-parallel shard's parameters held whole, AdamW's
    two moments included."""
    out: dict[str, Any] = {}
    for schedule in schedules:
        held = {}
        for sharded in (False, True):
            spec, plan = _llama("whole")
            whole = nn.Sequential(*copy.deepcopy(spec.blocks))
            pipe = Pipeline(
                spec.blocks,
                spec.loss_fn,
                schedule,
                n_microbatches=4,
                data_parallel=2,
                tensor_parallel=2,
                tensor_parallel_plan=plan,
                shard_parameters=sharded,
            )
            optimizer = pipe.shard_optimizer(torch.optim.AdamW, lr=1e-2)
            reference = torch.optim.AdamW(whole.parameters(), lr=1e-2)
            error = 0.0
            for step in range(STEPS):
                inputs, targets = spec.make_batch(16, step)
                mine = slice(8 * pipe.dp_rank, 8 * (pipe.dp_rank + 1))
                loss = pipe.step(inputs[mine], targets[mine])
                reference.zero_grad()
                expected = spec.loss_fn(whole(inputs), targets)
                expected.backward()
                error = max(error, abs(loss - float(expected.detach())))
                norm = pipe.clip_grad_norm_(CLIP)
                expected_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), CLIP)
                assert expected_norm > CLIP  # the step clips
                error = max(error, abs(float(norm) - float(expected_norm)))
                optimizer.step()
                reference.step()
                if step == 0:
                    stats = pipe.memory_stats(optimizer)
                optimizer.zero_grad()
            held[sharded] = stats["parameters"] + stats["optimizer"]
            if not sharded:  # this shard's parameters, gradients and AdamW's two moments
                held["whole"] = 4 * sum(
                    p.numel() * p.element_size() for p in pipe.module.parameters()
                )
            out[f"{schedule} sharded={sharded}"] = error
            pipe.close()
        out[f"{schedule} held"] = held
    return out
