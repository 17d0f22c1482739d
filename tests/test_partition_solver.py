"""The partition solver against brute force, its tie-breaking, memory limits and errors."""

import math
import subprocess
import sys
from fractions import Fraction
from itertools import combinations, pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twobp.partition import check_partition, evaluate, solve, solver, stage_ranges, uniform


def all_partitions(n_blocks, n_stages):
    for cuts in combinations(range(1, n_blocks), n_stages - 1):
        bounds = [0, *cuts, n_blocks]
        yield [b - a for a, b in pairwise(bounds)]


def brute_force(costs, n_stages, memory=None, limit=None):
    """The documented optimum, in exact arithmetic: least bottleneck, then least
    sum of squares, then earliest cuts (smallest sizes, lexicographically)."""
    best = None
    for sizes in all_partitions(len(costs), n_stages):
        sums = [sum(Fraction(costs[i]) for i in r) for r in stage_ranges(sizes)]
        if limit is not None:
            mems = [sum(Fraction(memory[i]) for i in r) for r in stage_ranges(sizes)]
            if max(mems) > Fraction(limit):
                continue
        key = (max(sums), sum(s * s for s in sums), sizes)
        best = key if best is None or key < best else best
    return None if best is None else best[2]


def test_finds_the_obvious_balance():
    result = solve([1, 1, 1, 1, 1, 1], 3)
    assert result.sizes == [2, 2, 2]
    assert result.stage_costs == [2, 2, 2]
    assert result.bottleneck == 2
    assert result.stage_memory is None


def test_a_heavy_block_gets_a_stage_of_its_own():
    result = solve([1, 1, 10, 1, 1, 1], 3)
    assert result.bottleneck == 10
    assert result.sizes == [2, 1, 3]


def test_heavy_head_and_embedding_shrink_first_and_last_stages():
    costs = [3, *[1] * 10, 3]
    result = solve(costs, 4)
    assert result.sizes == [2, 4, 4, 2]
    assert result.stage_costs == [4, 4, 4, 4]


def test_among_equal_bottlenecks_the_most_even_split_wins():
    # Bottleneck 4 needs block 0 alone; then (4 | 2 | 2) beats the earlier cuts
    # of (4 | 1 | 3) on the sum of squares.
    result = solve([4, 1, 1, 1, 1], 3)
    assert result.bottleneck == 4
    assert result.sizes == [1, 2, 2]


def test_remaining_ties_go_to_the_earliest_cut():
    # Both [1 | 2, 1] and [1, 2 | 1] are (3, 1) up to order: the earlier cut wins.
    assert solve([1, 2, 1], 2).sizes == [1, 2]
    # Zero-cost blocks make many splits equal; the earliest cuts win.
    assert solve([0, 0, 0, 0], 2).sizes == [1, 3]


def test_float_sums_that_are_equal_in_exact_arithmetic_tie():
    # 0.1 + 0.2 != 0.3 in floats, but both orders give the same exact sums here.
    a = solve([0.1, 0.2, 0.3], 2)
    b = solve([0.3, 0.2, 0.1], 2)
    assert a.sizes == [2, 1] and b.sizes == [1, 2]
    assert a.bottleneck == b.bottleneck


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_matches_brute_force(data):
    n_blocks = data.draw(st.integers(1, 9), label="n_blocks")
    n_stages = data.draw(st.integers(1, n_blocks), label="n_stages")
    value = st.one_of(st.integers(0, 6), st.floats(0, 10, allow_nan=False))
    costs = data.draw(st.lists(value, min_size=n_blocks, max_size=n_blocks), label="costs")
    result = solve(costs, n_stages)
    assert result.sizes == brute_force(costs, n_stages)
    assert result.bottleneck == max(evaluate(costs, result.sizes).stage_costs)
    check_partition(result.sizes, n_blocks, n_stages)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_matches_brute_force_under_a_memory_limit(data):
    n_blocks = data.draw(st.integers(1, 8), label="n_blocks")
    n_stages = data.draw(st.integers(1, n_blocks), label="n_stages")
    ints = st.lists(st.integers(0, 6), min_size=n_blocks, max_size=n_blocks)
    costs, memory = data.draw(ints, label="costs"), data.draw(ints, label="memory")
    limit = data.draw(st.integers(max(memory), max(sum(memory), max(memory))), label="limit")
    expected = brute_force(costs, n_stages, memory, limit)
    if expected is None:
        with pytest.raises(ValueError, match="at least"):
            solve(costs, n_stages, memory=memory, memory_limit=limit)
        return
    result = solve(costs, n_stages, memory=memory, memory_limit=limit)
    assert result.sizes == expected
    assert max(result.stage_memory) <= limit


def test_memory_limit_moves_the_cut_away_from_the_cost_optimum():
    costs, memory = [1, 1, 1, 1], [5, 1, 1, 1]
    assert solve(costs, 2).sizes == [2, 2]
    limited = solve(costs, 2, memory=memory, memory_limit=5)
    assert limited.sizes == [1, 3]
    assert limited.stage_memory == [5, 3]
    assert limited.bottleneck == 3


def test_memory_without_a_limit_is_reported():
    assert solve([1, 1], 2, memory=[2, 3]).stage_memory == [2, 3]


def test_solves_hundreds_of_blocks_quickly(monkeypatch):
    costs = [1.0 + (i * 7919 % 13) / 10 for i in range(300)]
    checks = []
    min_stages = solver._Fits.min_stages

    def counted(fits, bottleneck):
        checks.append(bottleneck)
        return min_stages(fits, bottleneck)

    monkeypatch.setattr(solver._Fits, "min_stages", counted)
    result = solve(costs, 16)
    # Quickly: one check of the whole chain, then a binary search over the distinct sums of
    # runs of blocks (at most 300 * 301 / 2), each check one pass over the blocks.
    assert 2 <= len(checks) <= 2 + math.ceil(math.log2(300 * 301 / 2))
    assert sum(result.sizes) == 300 and len(result.sizes) == 16
    # A lower bound: no split beats the mean stage, nor the heaviest block.
    assert result.bottleneck >= max(sum(costs) / 16, max(costs))
    assert result.bottleneck <= evaluate(costs, uniform(300, 16)).bottleneck


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (([1, 1], 3), {}, "cannot split 2 blocks into 3 non-empty stages"),
        (([1, 1], 0), {}, "n_stages must be >= 1"),
        (([1, -1], 1), {}, "block 1 has -1"),
        (([1, float("nan")], 1), {}, "block 1 has nan"),
        (([1, 1], 1), {"memory_limit": 3}, "pass memory="),
        (([1, 1], 1), {"memory": [1]}, "memory has 1 entries"),
        (([1, 1, 1], 2), {"memory": [1, 7, 1], "memory_limit": 5}, "block 1 alone needs 7"),
        (([1, 1, 1], 2), {"memory": [3, 3, 3], "memory_limit": 5}, "at least 3 stages"),
    ],
)
def test_impossible_requests_say_why(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve(*args, **kwargs)


@pytest.mark.parametrize(
    ("n_blocks", "n_stages", "expected"),
    [
        (8, 4, [2, 2, 2, 2]),
        (10, 4, [2, 3, 3, 2]),
        (9, 4, [2, 3, 2, 2]),
        (11, 4, [3, 3, 3, 2]),
        (34, 4, [8, 9, 9, 8]),
        (3, 3, [1, 1, 1]),
        (5, 1, [5]),
    ],
)
def test_uniform_puts_extra_blocks_in_the_middle(n_blocks, n_stages, expected):
    assert uniform(n_blocks, n_stages) == expected


@given(st.integers(1, 200), st.integers(1, 40))
def test_uniform_is_always_a_valid_even_partition(n_blocks, n_stages):
    if n_stages > n_blocks:
        with pytest.raises(ValueError, match="non-empty"):
            uniform(n_blocks, n_stages)
        return
    sizes = uniform(n_blocks, n_stages)
    check_partition(sizes, n_blocks, n_stages)
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("partition", "match"),
    [
        ([3, 3], "has 2 stages, but the pipeline has 3"),
        ([3, 0, 3], r"stage\(s\) \[1\] hold no block"),
        ([3, -1, 4], r"stage\(s\) \[1\] hold no block"),
        ([3, 3, 3], "covers 9 blocks, but the model has 6"),
    ],
)
def test_check_partition_says_what_is_wrong(partition, match):
    with pytest.raises(ValueError, match=match):
        check_partition(partition, 6, 3)


def test_evaluate_and_ranges():
    result = evaluate([1, 2, 3, 4], [1, 3], memory=[1, 1, 1, 1])
    assert result.stage_costs == [1, 9] and result.bottleneck == 9
    assert result.stage_memory == [1, 3]
    assert result.ranges() == [range(0, 1), range(1, 4)]


def test_solver_imports_no_torch():
    code = "import sys, twobp.partition.solver; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
