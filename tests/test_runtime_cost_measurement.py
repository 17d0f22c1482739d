"""What ``schedule="auto"`` measures between ranks, on real gloo ranks."""

from __future__ import annotations

import pytest

from auto_schedule_workers import link_figures
from twobp.runtime import launch


@pytest.mark.timeout(120)
def test_the_link_between_any_two_ranks_is_measured_and_shared_with_every_rank():
    # Rank 1 stands by: the link is between group ranks 2 and 0, in that order.
    figures = launch(link_figures, 3, (2, 0), 2**16, threads_per_rank=1, timeout=90)
    assert figures[0] == figures[1] == figures[2]
    latency, bandwidth = figures[0]
    assert 0 < latency < 1 and bandwidth > 0
