"""Measured blocks to a per-stage cost model (pure: made-up block figures)."""

from dataclasses import dataclass

import pytest

from twobp.sim.from_profile import stage_cost_model


@dataclass(frozen=True)
class Block:
    forward: float
    backward_input: float = 2.0
    backward_weight: float = 1.0
    backward_full: float = 2.5
    activation_bytes: int = 10
    weight_grad_bytes: int = 4
    output_bytes: int = 100
    parameter_bytes: int = 7


BLOCKS = [Block(1.0), Block(2.0, output_bytes=200), Block(4.0, output_bytes=300)]


def test_a_stage_is_the_sum_of_its_blocks_and_sends_its_last_output():
    model = stage_cost_model(BLOCKS, [2, 1], meta={"model": "made up"})
    assert model.forward == (3.0, 4.0)
    assert model.backward_input == (4.0, 2.0)
    assert model.backward_full == (5.0, 2.5)
    assert model.send_bytes == (200.0, 300.0)
    assert model.activation_bytes == (20.0, 10.0)
    assert model.weight_grad_bytes == (8.0, 4.0)
    assert model.parameter_bytes == (14.0, 7.0)
    assert model.weight_concat is None and model.contention == 1.0
    assert model.meta == {"model": "made up"}


def test_contended_times_become_alone_times_and_tables_keep_the_common_counts():
    tables = [{1: 1.0, 2: 1.5, 4: 2.0}, {1: 1.0, 4: 3.0}, {1: 2.0, 8: 6.0}]
    model = stage_cost_model(BLOCKS, [2, 1], weight_concat=tables, contention=2.0)
    assert model.forward == (1.5, 2.0)
    assert model.weight_concat == ({1: 1.0, 4: 2.5}, {1: 1.0, 8: 3.0})
    assert model.contention == 2.0
    # Sizes are not times: the contention leaves them alone.
    assert model.send_bytes == (200.0, 300.0)


def test_a_partition_or_tables_that_do_not_fit_the_blocks_are_refused():
    with pytest.raises(ValueError, match="covers 2 blocks"):
        stage_cost_model(BLOCKS, [1, 1])
    with pytest.raises(ValueError, match="2 tables for 3 blocks"):
        stage_cost_model(BLOCKS, [2, 1], weight_concat=[{1: 1.0}, {1: 1.0}])


def test_partition_for_splits_uniformly_by_costs_or_as_given():
    from twobp.sim.from_profile import partition_for

    assert partition_for(3, None, None)(2) == (2, 1)
    assert partition_for(3, "balanced", [1.0, 1.0, 5.0])(2) == (2, 1)
    assert partition_for(3, "balanced", [5.0, 1.0, 1.0])(2) == (1, 2)
    given = partition_for(3, [1, 2], None)
    assert given(2) == (1, 2)
    with pytest.raises(ValueError, match=r"partition \[1, 2\] has 2 stages, not 3"):
        given(3)
    with pytest.raises(ValueError, match="4 stages need at least 4 blocks"):
        partition_for(3, None, None)(4)


def test_profiled_costs_keep_contention_and_count_parameters_with_their_gradients():
    from twobp.sim.from_profile import partition_for, profiled_costs

    tables = [{1: 1.0, 4: 2.0}] * 3
    costs_for = profiled_costs(
        BLOCKS, tables, partition_for(3, None, None), contention=1.5, parameter_factor=2.0
    )
    model = costs_for(3)
    assert model.contention == 1.5
    assert model.forward == (1.0, 2.0, 4.0)  # alone times: not divided by the contention
    assert model.parameter_bytes == (14.0, 14.0, 14.0)
    assert model.w_time(0, 4) == 2.0
    assert costs_for(1).forward == (7.0,)


def test_the_optimizer_state_is_counted_per_stage_and_sharded_if_it_will_be():
    from twobp.sim.from_profile import partition_for, profiled_costs, with_optimizer_state

    sizes_for = partition_for(3, None, None)
    costs_for = profiled_costs(BLOCKS, None, sizes_for)
    counted = with_optimizer_state(costs_for, sizes_for, [10, 20, 40], 8.0)
    assert counted(3).optimizer_bytes == (80.0, 160.0, 320.0)
    assert counted(1).optimizer_bytes == (560.0,)
    assert not counted(3).shard_optimizer
    sharded = with_optimizer_state(costs_for, sizes_for, [10, 20, 40], 8.0, sharded=True)
    assert sharded(3).shard_optimizer and sharded(3).gather_pieces == 1
    assert sharded(1).gather_pieces == 3
    assert with_optimizer_state(costs_for, sizes_for, [10, 20, 40], 0.0) is costs_for
    with pytest.raises(ValueError, match="optimizer_state_bytes"):
        with_optimizer_state(costs_for, sizes_for, [10, 20, 40], -1.0)
