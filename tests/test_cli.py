import subprocess
import sys

from twobp.cli.main import main


def test_help_lists_the_program(capsys):
    assert main([]) == 0
    assert "twobp" in capsys.readouterr().out


def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "twobp.cli.main", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "2-stage backpropagation" in out.stdout


def test_top_level_names_load_lazily():
    import twobp

    assert twobp.Pipeline.__name__ == "Pipeline"
    assert callable(twobp.launch) and callable(twobp.defer_weight_grads)


def test_bench_without_its_package_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "twobp_bench", None)
    monkeypatch.setitem(sys.modules, "twobp_bench.cli", None)
    assert main(["bench", "--quick", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "twobp_bench) is not installed" in err and "pip install -e ." in err
