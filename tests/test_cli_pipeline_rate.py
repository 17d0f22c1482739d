"""The slowdown of blocks inside a running pipeline, read from its timeline."""

import torch

from twobp.cli.pipeline_rate import pipeline_slowdown


def test_the_slowdown_is_the_ranks_compute_over_the_profiled_costs():
    # Profiled costs of a microsecond per micro-batch: the two ranks' real compute
    # (a tiny LLaMA's blocks, 4 micro-batches) is thousands of times that.
    changes = {"n_layers": 2, "seq_len": 16}
    tiny = 1e-6
    ratio = pipeline_slowdown("llama", "tiny", changes, torch.float32, 2, (2, 2), (tiny, tiny))
    assert ratio > 100
    # Costs far above what runs: never below 1 (a pipeline is not faster than its blocks).
    assert pipeline_slowdown("llama", "tiny", changes, torch.float32, 2, (2, 2), (1e3, 1e3)) == 1
