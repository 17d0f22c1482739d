"""What freeing a stage's gathered weights before its W saves, measured and simulated.

The case of ``tests/test_runtime_sharded_peak.py``: 2 x 2 gloo ranks, the tests' float64
MLP, ``shard_parameters=True`` with 2BP and ``recompute="activations"``, 4 micro-batches
of 16 rows. Per schedule and rank: the most bytes of activations, stashes, whole
gradients and gathered weights held at once after a compute action, measured with the
weights freed after each stage's last I (as twobp runs) and kept through its last W, and
the difference that ``peak_memory`` predicts from the profiled blocks. Prints one markdown table.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/sharded_parameters/free_before_w.py
"""

from __future__ import annotations

from sharded_parameters_workers import freed_peaks
from test_runtime_sharded_peak import ROWS, SCHEDULES, predicted
from twobp.runtime import launch


def main() -> int:
    results = launch(freed_peaks, 4, SCHEDULES, ROWS, timeout=300)
    print("| schedule | rank | freed before W | kept through W | saved | simulated saving |")
    print("|---|---|---|---|---|---|")
    for name in SCHEDULES:
        before, after = predicted(results[0][name]["schedule"])
        for rank in range(2):
            runs = results[rank][name]["runs"]
            low, high = runs[True][0], runs[False][1]
            print(
                f"| {name} | {rank} | {low} | {high} | {high - low} "
                f"| {after[rank] - before[rank]:.0f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
