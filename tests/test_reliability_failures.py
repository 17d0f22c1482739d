"""A rank that stalls: the others end within the timeout, and the launcher names it.

(A rank that raises is tested in ``test_reliability_inputs``, a killed rank in
``test_runtime_distributed``, a rank killed while saving in
``test_checkpoint_pipeline``, and a rank killed under ``torchrun`` in
``test_checkpoint_train``.)
"""

from __future__ import annotations

import pytest

from reliability_workers import stalled_rank_session
from twobp.runtime import LaunchError, launch
from twobp.runtime.errors import RankFailure, last_frame

TIMEOUT = 3.0
GRACE = 1.0


def test_a_stalled_rank_is_named_with_where_it_was():
    with pytest.raises(LaunchError) as info:
        launch(
            stalled_rank_session, 2, TIMEOUT, threads_per_rank=1, grace_period=GRACE, timeout=120
        )
    error = info.value
    stuck, waiting = error.failures
    # Rank 1 never returns from its loss; rank 0 gives up after the timeout.
    assert waiting.rank == 0 and waiting.error_type == "PeerTimeoutError"
    assert waiting.peer == 1
    assert waiting.message.startswith(f"rank 0 at 0I0 waited more than {TIMEOUT:g} s")
    assert "from rank 1; rank 1 is stuck, slow or gone" in waiting.message
    # The launcher terminates it, names it as the cause and shows where it was.
    assert stuck.rank == 1 and stuck.stuck and stuck.exitcode is not None
    assert stuck.message.startswith("stuck: rank(s) 0 timed out waiting on it")
    assert "in __call__" in last_frame(stuck.stack)
    assert "reliability_workers.py" in stuck.summary()
    assert str(error).startswith(
        "2 of 2 processes failed; rank 1 was stuck (the others timed out waiting on it)"
    )


def test_last_frame_reads_both_stack_orders():
    dump = (
        "Current thread 0x1 (most recent call first):\n"
        '  File "/a/loss.py", line 9 in __call__\n'
        '  File "/a/stage.py", line 3 in forward\n'
    )
    assert last_frame(dump) == '"/a/loss.py", line 9 in __call__'
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/a/run.py", line 1, in main\n'
        '  File "/a/loss.py", line 9, in __call__\n'
    )
    assert last_frame(traceback) == '"/a/loss.py", line 9, in __call__'
    terminated = RankFailure(1, -15, message="terminated", stack=dump)
    assert terminated.summary() == 'rank 1: terminated; it was at "/a/loss.py", line 9 in __call__'
