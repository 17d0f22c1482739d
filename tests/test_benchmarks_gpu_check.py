"""The GPU check script (prepared for one GPU) runs end to end on a CPU with tiny sizes."""

import json

import pytest

from repo_scripts import load_script
from twobp.runtime.execution import recompute

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/gpu_check/run.py")


def test_every_part_runs_and_passes_on_a_cpu(script, tmp_path, capsys):
    results = script.main(["--device", "cpu", "--small", "--out", str(tmp_path)])
    assert results["ok"]
    assert json.loads((tmp_path / "results.json").read_text())["ok"]
    assert (tmp_path / "paper-layers" / "results.json").is_file()
    engine = results["engine"]
    assert {"gradients 1f1b", "gradients zb-v", "autocast bfloat16", "memory"} <= set(engine)
    assert {f"recompute {m} with dropout" for m in script.RECOMPUTE} <= set(engine)
    steps = {(r["schedule"], r["two_bp"]) for r in results["one_device_steps"]}
    assert steps == {(s, b) for s in script.STEP_SCHEDULES for b in (False, True)}
    simulated = {(r["schedule"], r["policy"]) for r in results["simulated"]}
    assert simulated == {(s, p) for s in script.SIMULATED for p in ("off", "paper")}
    assert all(not r["error"] for r in results["simulated"])
    assert "all checks pass" in capsys.readouterr().out


def test_a_recomputed_forward_that_draws_other_dropout_masks_fails_the_check(script, monkeypatch):
    # Without the replay of the random states, the recomputed forward draws other masks.
    monkeypatch.setattr(recompute.RngState, "replay", lambda self: _nothing())
    engine = script.engine_checks(script.torch.device("cpu"), 16, 3, 16)
    assert not engine["recompute activations with dropout"]["ok"]
    assert engine["gradients 1f1b"]["ok"]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
