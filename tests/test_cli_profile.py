"""`twobp profile` measures real blocks and writes a profile the simulator reads."""

import pytest

from twobp.cli.main import main
from twobp.sim import load_costs


def test_profile_writes_costs_that_simulate_reads(tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = ["profile", "--microbatch-size", "2", "--stages", "2", "--repeats", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "balanced partition over 2 stages" in printed
    costs = load_costs(out)
    assert costs.n_stages == 2
    assert all(t > 0 for t in (*costs.forward, *costs.backward_input, *costs.backward_weight))
    argv = ["simulate", "--costs-file", str(out), "--stages", "2", "--microbatches", "4"]
    assert main([*argv, "--policy", "paper"]) == 0
    assert "bubble ratio" in capsys.readouterr().out


def test_profile_refuses_an_impossible_memory_limit(tmp_path, capsys):
    argv = ["profile", "--repeats", "1", "--memory-limit", "10", "--out", str(tmp_path / "p.json")]
    assert main(argv) == 2
    assert "twobp profile:" in capsys.readouterr().err


def test_profile_refuses_a_model_that_does_not_fit_before_building_it(
    tmp_path, capsys, monkeypatch
):
    # A 23 GB machine: LLaMA-7B's weights and gradients alone need 54 GB in float32.
    monkeypatch.setattr("twobp.cli.profile.available_memory", lambda: 23e9)
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "llama", "--size", "7b", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == ""
    assert "53.9 GB" in lines[0] and "23.0 GB available" in lines[0]
    assert "twobp plan --model llama --size 7b" in lines[0]
    assert not out.exists()


def test_what_profiling_needs_against_what_there_is():
    from twobp.cli.errors import UsageError
    from twobp.cli.profile import check_fits

    check_fits("llama-tiny", 10**6, 4, 1e9)
    check_fits("llama-7b", 7 * 10**9, 4, None)  # unknown: try
    check_fits("llama-7b", 10**9, 2, 4e9)  # 4 GB needed, 4 GB there
    with pytest.raises(UsageError, match=r"4\.0 GB .* 3\.9 GB available.*twobp plan --costs"):
        check_fits("resnet-152", 10**9, 2, 3.9e9)


def test_profile_fits_this_machine_for_the_plan(tmp_path, capsys):
    from twobp.sim.analytic import load_hardware

    device = tmp_path / "cpu.json"
    argv = ["profile", "--repeats", "1", "--set", "n_layers=2,seq_len=16"]
    argv += ["--out", str(tmp_path / "p.json"), "--hardware-out", str(device)]
    assert main(argv) == 0
    assert f"wrote {device}: weight matrices at" in capsys.readouterr().out
    fitted = load_hardware(str(device))
    assert fitted.peak_fp32 > 0 and fitted.efficiency["matmul"] == 1.0
    assert "2 layers of llama-tiny (dim 64, 4 x 16 tokens)" in fitted.source
    plan = ["plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--ffn", "176"]
    plan += ["--vocab", "256", "--gpus", "2", "--gpu", str(device), "--seq-len", "16"]
    assert main([*plan, "--global-batch", "16"]) == 0
    assert "on 2 x cpu" in capsys.readouterr().out


def test_profile_refuses_to_fit_a_device_to_a_model_without_decoder_layers(tmp_path, capsys):
    argv = ["profile", "--model", "resnet", "--hardware-out", str(tmp_path / "d.json")]
    assert main([*argv, "--out", str(tmp_path / "p.json")]) == 2
    assert "--hardware-out: fitted to LLaMA decoder layers" in capsys.readouterr().err
    assert main(["profile", "--set", "dim", "--out", str(tmp_path / "p.json")]) == 2
    assert "--set: expected name=value, got 'dim'" in capsys.readouterr().err
