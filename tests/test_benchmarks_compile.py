"""The compile benchmark's order of variants and its round-by-round speed-ups (pure helpers;
the benchmark itself compiles whole models and runs for minutes)."""

import statistics

import pytest

from repo_scripts import load_script

NAMES = [
    "twobp eager",
    "twobp compile",
    "twobp compile, regions compiled",
    "torch 1F1B",
    "torch 1F1B compile",
    "torch GPipe",
    "torch GPipe compile",
]


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/compile/run.py")


def test_each_eager_variant_runs_back_to_back_with_its_compiled_one_in_a_shuffled_order(script):
    assert script._pairs(NAMES) == [
        ["twobp eager", "twobp compile"],
        ["twobp compile, regions compiled"],
        ["torch 1F1B", "torch 1F1B compile"],
        ["torch GPipe", "torch GPipe compile"],
    ]
    steps = dict.fromkeys(NAMES, lambda: None)
    orders = [[name for name, _ in script._in_turn(steps, k)] for k in range(40)]
    for order in orders:
        assert sorted(order) == sorted(NAMES)
        for eager, compiled in (
            ("twobp eager", "twobp compile"),
            ("torch 1F1B", "torch 1F1B compile"),
        ):
            assert abs(order.index(eager) - order.index(compiled)) == 1
    # the same order on every rank (by the round's number), another from round to round
    assert orders[3] == [name for name, _ in script._in_turn(steps, 3)]
    assert len({tuple(o) for o in orders}) > 20
    firsts = {o[0] for o in orders}
    assert len(firsts) == len(NAMES)
    eager_first = sum(o.index("twobp eager") < o.index("twobp compile") for o in orders)
    assert 10 <= eager_first <= 30


def test_the_speed_up_is_the_median_of_each_round_s_ratio_not_the_ratio_of_medians(script):
    # Round by round the compiled variant is 10% faster; the machine slows down for good
    # from round 3 on, and in round 2 for the compiled step already. The ratio of the
    # medians (1.0 against 2.7) would say compile is 2.7x slower.
    eager = [1.0, 1.0, 1.0, 3.0, 3.0]
    compiled = [0.9, 0.9, 2.7, 2.7, 2.7]
    times = {
        "twobp eager": {"wall": eager, "cpu": eager},
        "twobp compile": {"wall": compiled, "cpu": compiled},
        "twobp compile, regions compiled": {"wall": compiled, "cpu": compiled},
    }
    out = script._medians(times)
    assert out["cpu"]["twobp eager"] == statistics.median(eager) == 1.0
    assert out["cpu"]["twobp compile"] == 2.7
    q1, median, q3 = out["speed-up"]["cpu"]["twobp"]
    assert median == pytest.approx(1 / 0.9)
    assert q1 <= median <= q3
    assert set(out["speed-up"]["wall"]) == {"twobp"}
    assert script._quartiles([1.0, 1.1, 1.2]) == "1.100x [1.000-1.200]"
    assert script._share(1.02, 1.04) == "50%"
