"""`twobp profile` measures real blocks and writes a profile the simulator reads."""

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
