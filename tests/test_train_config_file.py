"""`twobp train --config run.toml`: every option as a key, the command line over the file.

A run from a TOML file writes the options it ran with to ``OUT/config.toml``;
``--config OUT/config.toml`` repeats it exactly (the same loss curve, bitwise,
in float64). A wrong key or value is one line naming the file and the key, and
exit code 2, before any rank starts.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from twobp.cli.main import build_parser, main
from twobp.cli.train import train_config
from twobp.config import read_toml, to_toml
from twobp.train.config import TrainConfig

RUN_TOML = """
# a small run
steps = 3
batch-size = 4
microbatches = 2
seq_len = 16
dtype = "float64"
threads = 1
two_bp = false
lr = 1          # an integer is a number too
timeout = 60
"""


def _parse(argv: list[str]) -> TrainConfig:
    return train_config(build_parser().parse_args(["train", *argv]))[0]


def test_a_config_file_round_trips_and_the_command_line_overrides_it(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(RUN_TOML)
    first, second = tmp_path / "first", tmp_path / "second"
    argv = ["--config", str(tmp_path / "run.toml"), "--out", str(first), "--save-every", "2"]
    assert main(["train", *argv]) == 0
    written = first / "config.toml"
    cfg = read_toml(TrainConfig, written)
    assert cfg["steps"] == 3 and cfg["batch_size"] == 4 and cfg["two_bp"] is False
    assert cfg["lr"] == 1.0 and isinstance(cfg["lr"], float) and cfg["save_every"] == 2
    assert "resume" not in cfg  # None: left out, and left at its default when read back
    # The written file repeats the run: the same options, the same loss curve.
    assert main(["train", "--config", str(written), "--out", str(second)]) == 0
    again = read_toml(TrainConfig, second / "config.toml")
    assert {**again, "out": None} == {**cfg, "out": None}
    metrics = [json.loads((out / "metrics.json").read_text()) for out in (first, second)]
    assert metrics[0]["losses"] == metrics[1]["losses"]
    assert metrics[0]["config"] == {**metrics[1]["config"], "out": str(first)}
    capsys.readouterr()


def test_command_line_options_override_the_file_and_defaults_fill_the_rest(tmp_path):
    (tmp_path / "run.toml").write_text(RUN_TOML)
    cfg = _parse(["--config", str(tmp_path / "run.toml"), "--steps", "7", "--two-bp"])
    assert (cfg.steps, cfg.two_bp, cfg.batch_size) == (7, True, 4)
    # An option given on the command line overrides the file even when it equals its default.
    assert _parse(["--config", str(tmp_path / "run.toml"), "--lr", "3e-3"]).lr == 3e-3
    assert _parse(["--config", str(tmp_path / "run.toml")]).schedule == "1f1b"
    assert _parse([]) == TrainConfig()


def test_to_toml_writes_what_read_toml_reads(tmp_path):
    cfg = TrainConfig(data='a "quoted" path\\with\tback slashes é', lr=1e-05, timeout=float("inf"))
    path = tmp_path / "c.toml"
    path.write_text(to_toml(dataclasses.asdict(cfg), "line one\nline two"))
    assert path.read_text().startswith("# line one\n# line two\n")
    assert TrainConfig(**read_toml(TrainConfig, path)) == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3", "run.toml: unknown key 'stepz'; did you mean 'steps'?"),
        ('steps = "3"', "run.toml: key 'steps' = \"3\": expected an integer"),
        ("steps = 3.5", "run.toml: key 'steps' = 3.5: expected an integer"),
        ("two_bp = 1", "run.toml: key 'two_bp' = 1: expected true or false"),
        ('model = "gpt"', "run.toml: key 'model' = \"gpt\": choose from llama, bert, mamba"),
        ("steps = 0", "run.toml, key steps: --steps must be >= 1, got 0"),
        ('schedule = "foo"', "run.toml, key schedule: --schedule foo: unknown schedule 'foo'"),
        ("batch_size = 3", "run.toml, key batch_size: --batch-size 3 holds fewer samples than 4"),
        ("steps =", "--config {path}: not valid TOML: "),
    ],
)
def test_a_wrong_key_or_value_is_one_line_naming_the_key(text, message, tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    argv = ["train", "--config", str(path), "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("twobp train: error: "), err
    assert message.format(path=path) in err
    assert not (tmp_path / "out").exists()  # no rank started, nothing written


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert f"--config {tmp_path / 'none.toml'}: cannot read it" in capsys.readouterr().err


def test_an_option_on_the_command_line_is_not_blamed_on_the_file(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("steps = 3\n")
    assert main(["train", "--config", str(tmp_path / "run.toml"), "--warmup", "-1"]) == 2
    err = capsys.readouterr().err
    assert "twobp train: error: --warmup must be >= 0, got -1" in err and "run.toml" not in err


def test_every_option_is_a_key(tmp_path):
    # Every option of the command line, given in a file, reaches the run's options.
    values = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    values.update(stages_per_rank=2, data="x.txt", threads=3, resume="auto", stop_after=9)
    values = {name: not v if isinstance(v, bool) else v for name, v in values.items()}
    (tmp_path / "all.toml").write_text(to_toml(values))
    assert dataclasses.asdict(_parse(["--config", str(tmp_path / "all.toml")])) == values


def test_the_written_file_is_toml_that_python_reads():
    # The reader twobp itself uses: tomllib, or tomli (a dependency) before Python 3.11.
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    text = to_toml({"a": 1, "b": 2.5, "c": "x", "d": True, "e": [1, 2], "f": None})
    assert tomllib.loads(text) == {"a": 1, "b": 2.5, "c": "x", "d": True, "e": [1, 2]}
