import json
import math

import pytest

from twobp.schedule.action import Action
from twobp.sim.cost_io import load_costs, parse_amount, parse_costs, save_costs
from twobp.sim.costs import CostModel


def test_uniform_defaults_fuse_backward_as_input_plus_weight():
    costs = CostModel.uniform(3, f=1, i=2, w=3)
    assert costs.n_stages == 3
    assert costs.backward_full == (5.0, 5.0, 5.0)
    assert costs.duration(Action.parse("1B0")) == 5.0
    assert costs.duration(Action.parse("1F0")) == 1.0
    assert costs.duration(Action.parse("1I0")) == 2.0
    assert costs.duration(Action.parse("1W0-3")) == 12.0
    assert costs.duration(Action.parse("1SEND_F0")) == 0.0


def test_weight_concat_table_interpolates_and_extrapolates():
    costs = CostModel.uniform(1, w=1, weight_concat={1: 1.0, 4: 3.0})
    assert costs.w_time(0, 1) == pytest.approx(1.0)
    assert costs.w_time(0, 2) == pytest.approx(1.0 + 2.0 / 3.0)
    assert costs.w_time(0, 4) == pytest.approx(3.0)
    # Beyond the last measured point: the slope of the last segment (2/3 per micro-batch).
    assert costs.w_time(0, 7) == pytest.approx(5.0)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    costs = CostModel.uniform(2, send_latency=0.5, bandwidth=100.0, send_bytes=50.0)
    assert costs.transfer_time(0) == pytest.approx(1.0)
    assert CostModel.uniform(2).transfer_time(0) == 0.0


def test_parse_costs_reads_keys_and_suffixes():
    costs = parse_costs("F=1, I=2, w=0.5, B=2.25, latency=1e-3, bandwidth=1GB, send=4MiB, act=2", 4)
    assert costs.forward == (1.0,) * 4
    assert costs.backward_input == (2.0,) * 4
    assert costs.backward_weight == (0.5,) * 4
    assert costs.backward_full == (2.25,) * 4
    assert costs.send_latency == 1e-3
    assert costs.bandwidth == 1e9
    assert costs.send_bytes == (4 * 2**20,) * 4
    assert costs.activation_bytes == (2.0,) * 4


def test_parse_costs_concat_table_sets_single_weight_time():
    costs = parse_costs("F=1,I=1,W1=1,W4=2", 2)
    assert costs.backward_weight == (1.0, 1.0)
    assert costs.w_time(1, 4) == 2.0


@pytest.mark.parametrize("text", ["F", "Q=1", "F=abc", "F=-1"])
def test_parse_costs_rejects_bad_text(text):
    with pytest.raises(ValueError):
        parse_costs(text, 2)


def test_parse_amount():
    assert parse_amount("16GiB") == 16 * 2**30
    assert parse_amount("80GB") == 80e9
    assert parse_amount("2.5") == 2.5
    assert parse_amount("inf") == math.inf
    with pytest.raises(ValueError, match="cannot read"):
        parse_amount("lots")


def test_wrong_length_names_the_field():
    with pytest.raises(ValueError, match="backward_input has 1 entries"):
        CostModel(forward=(1.0, 1.0), backward_input=(1.0,), backward_weight=(1.0, 1.0))


def test_json_round_trip(tmp_path):
    costs = CostModel(
        forward=(1.0, 2.0),
        backward_input=(1.5, 2.5),
        backward_weight=(0.5, 0.75),
        weight_concat=({1: 0.5, 4: 1.5}, None),
        send_latency=1e-4,
        send_overhead=2e-4,
        bandwidth=2.5e10,
        reduce_bandwidth=1.5e9,
        send_bytes=(100.0, 0.0),
        activation_bytes=(10.0, 20.0),
        weight_grad_bytes=(5.0, 6.0),
        parameter_bytes=(7.0, 8.0),
        meta={"model": "toy"},
    )
    path = tmp_path / "profile.json"
    save_costs(costs, path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "twobp-costs" and doc["version"] == 1
    assert doc["backward_weight_concat"][0] == {"1": 0.5, "4": 1.5}
    assert doc["reduce_bandwidth"] == 1.5e9
    loaded = load_costs(path)
    assert loaded == costs
    assert loaded.meta == {"model": "toy"}


def test_json_minimal_document_uses_defaults(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "format": "twobp-costs",
                "version": 1,
                "forward": [1, 1],
                "backward_input": [2, 2],
                "backward_weight": [3, 3],
            }
        )
    )
    costs = load_costs(path)
    assert costs.backward_full == (5.0, 5.0)
    assert costs.bandwidth == math.inf
    assert costs.parameter_bytes == (0.0, 0.0)


def test_json_wrong_version_says_what_to_do(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "twobp-costs", "version": 99, "forward": [1]}))
    with pytest.raises(ValueError, match="re-run the profiler"):
        load_costs(path)


def test_split_divides_time_and_memory_but_not_sent_bytes():
    costs = CostModel.uniform(2, f=2, i=4, w=6, send_bytes=8, activation_bytes=10).split(2)
    assert costs.n_stages == 4
    assert costs.forward == (1.0,) * 4
    assert costs.backward_full == (5.0,) * 4
    assert costs.send_bytes == (8.0,) * 4
    assert costs.activation_bytes == (5.0,) * 4


def test_for_stages_rejects_non_multiple():
    costs = CostModel.uniform(4)
    assert costs.for_stages(4) is costs
    assert costs.for_stages(8).n_stages == 8
    with pytest.raises(ValueError, match="profile the model with 6 stages"):
        costs.for_stages(6)


def test_split_and_tile_change_every_per_stage_field():
    import dataclasses

    from twobp.sim.costs import PER_STAGE_FIELDS

    costs = CostModel(
        forward=(1.0, 2.0),
        backward_input=(1.0, 2.0),
        backward_weight=(1.0, 2.0),
        send_bytes=(8.0, 0.0),
        parameter_bytes=(4.0, 6.0),
        reduce=(3.0, 5.0),
    )
    per_stage = [
        f.name
        for f in dataclasses.fields(CostModel)
        if isinstance(getattr(costs, f.name), tuple)
        and len(getattr(costs, f.name)) == 2
        and all(isinstance(v, float) for v in getattr(costs, f.name))
    ]
    assert sorted(per_stage) == sorted(PER_STAGE_FIELDS)
    tiled, split = costs.tile(3), costs.split(2)
    for name in PER_STAGE_FIELDS:
        assert getattr(tiled, name) == getattr(costs, name) * 3, name
        halves = tuple(v / (1 if name == "send_bytes" else 2) for v in getattr(costs, name))
        assert getattr(split, name) == tuple(v for v in halves for _ in range(2)), name


def test_parse_costs_reads_the_reduction_bandwidth():
    assert parse_costs("F=1,I=1,W=1,reduce_bandwidth=1.5GB", 2).reduce_bandwidth == 1.5e9
    assert parse_costs("F=1,I=1,W=1", 2).reduce_bandwidth is None
    with pytest.raises(ValueError, match="reduce_bandwidth must be None or > 0"):
        parse_costs("F=1,I=1,W=1,reduce_bandwidth=0", 2)
