"""The paper-layers script (prepared for a GPU) runs end to end on a CPU with small layers."""

import json
import math

import pytest
import torch

from repo_scripts import load_script

SMALL = ["--device", "cpu", "--dtype", "float32", "--dim", "32", "--ffn-dim", "48"]
SMALL += ["--heads", "2", "--tokens", "8", "--layers", "8", "--repeats", "1"]


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/paper_layers/run.py")


def test_it_measures_every_layer_shape_and_simulates_every_schedule(script, tmp_path, capsys):
    results = script.main([*SMALL, "--microbatches", "2", "4", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text())["simulated"] == results["simulated"]
    shapes = {(w["in"], w["out"], w["m"]) for w in results["weight_pass"]}
    assert shapes == {(i, o, m) for i, o in ((32, 32), (32, 48), (48, 32)) for m in (2, 4)}
    for entry in results["weight_pass"]:
        assert set(entry["seconds"]) == {"separate", "concatenated", "engine"}
        assert all(t > 0 for t in entry["seconds"].values())
    layer = results["layer"]
    assert all(layer[k] > 0 for k in ("forward", "backward_input", "backward_weight"))
    assert set(layer["weight_concat"]) == {"1", "2", "4"}
    runs = {(r["schedule"], r["policy"], r["microbatches"]) for r in results["simulated"]}
    assert runs == {
        (s, p, m)
        for s in ("gpipe", "1f1b", "zb-h2", "chimera")
        for p in ("off", "paper", "fill")
        for m in (2, 4)
    }
    assert all(math.isfinite(r["step_s"]) and not r["error"] for r in results["simulated"])
    printed = capsys.readouterr().out
    assert "| chimera | 4 |" in printed and "separate / concatenated" in printed


def test_the_three_weight_gradients_agree_or_it_stops(script, monkeypatch):
    times = script.weight_pass_times(16, 24, 8, 3, torch.device("cpu"), torch.float32, 1)
    assert set(times) == {"separate", "concatenated", "engine"}
    # A concatenation that drops a micro-batch must not be timed as if it were right.
    real_cat = torch.cat
    monkeypatch.setattr(script.torch, "cat", lambda ts, *a, **k: real_cat(ts[:-1], *a, **k))
    with pytest.raises(AssertionError, match="concatenated W of a 16 -> 24 layer differs"):
        script.weight_pass_times(16, 24, 8, 3, torch.device("cpu"), torch.float32, 1)
