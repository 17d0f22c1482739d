"""What reduce-scattering a stage's gradients after each W saves, measured and simulated.

The case of ``tests/test_runtime_sharded_scatter.py``: 2 x 2 gloo ranks, the tests'
float64 MLP, ``shard_parameters=True`` with 2BP and ``recompute="activations"``, 4
micro-batches of 2 rows. Per schedule and rank: the most bytes of activations, stashes,
whole gradients and gathered weights held at once after a compute action (and before
the end of each W and B), measured with the gradients reduce-scattered after each W
(``scatter_each_w=True``) and at R, the most bytes of whole gradients alone in each, and
the difference of the peaks that the simulator predicts from the profiled blocks. Prints
one markdown table.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/sharded_parameters/scatter_each_w.py
"""

from __future__ import annotations

from sharded_scatter_workers import gradient_peaks
from test_runtime_sharded_scatter import ROWS, SCHEDULES, predicted
from twobp.runtime import launch


def main() -> int:
    results = launch(gradient_peaks, 4, SCHEDULES, ROWS, timeout=300)
    print(
        "| schedule | rank | after each W | at R | saved | simulated saving "
        "| whole gradients after each W | at R |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for schedule, policy in SCHEDULES:
        name = f"{schedule} {policy}"
        each, at_r = predicted(results[0][name]["schedule"])
        for rank in range(2):
            runs = results[rank][name]["runs"]
            low, high = runs[True]["peak_freed_before_w"], runs[False]["peak_freed_before_w"]
            whole = (runs[True]["whole_gradients_peak"], runs[False]["whole_gradients_peak"])
            print(
                f"| {name} | {rank} | {low} | {high} | {high - low} "
                f"| {at_r[rank] - each[rank]:.0f} | {whole[0]} | {whole[1]} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
