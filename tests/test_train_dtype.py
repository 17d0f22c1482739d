"""`twobp train --dtype ... [--autocast]`: one switch for the compute dtype, checked up front.

``--dtype`` is the dtype the model computes in. Alone it casts the whole model
(pure bfloat16); with ``--autocast`` the parameters stay float32 and every
stage's forward runs under ``torch.autocast`` in that dtype
(``Pipeline(autocast=...)``). A dtype the device cannot run is one line naming
the option, exit 2, before any rank starts.
"""

from __future__ import annotations

import json

import pytest
import torch

from twobp.cli.main import main
from twobp.train.config import TrainConfig
from twobp.train.preflight import OptionError, check_dtype
from twobp.train.task import autocast_dtype, build_task, parameter_dtype

SHORT = [
    "--steps", "3", "--batch-size", "4", "--microbatches", "2", "--seq-len", "16",
    "--warmup", "1", "--threads", "1", "--timeout", "60", "--no-save",
]  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "autocast", "parameters", "pipeline"),
    [
        ("float32", False, torch.float32, None),
        ("bfloat16", False, torch.bfloat16, None),
        ("bfloat16", True, torch.float32, torch.bfloat16),
        ("float16", True, torch.float32, torch.float16),
    ],
)
def test_dtype_and_autocast_choose_the_parameters_and_the_pipeline(
    dtype, autocast, parameters, pipeline
):
    cfg = TrainConfig(dtype=dtype, autocast=autocast, seq_len=16)
    assert parameter_dtype(cfg) == parameters
    assert autocast_dtype(cfg) == pipeline
    task = build_task(cfg)
    assert {p.dtype for block in task.spec.blocks for p in block.parameters()} == {parameters}


def test_bfloat16_autocast_trains_on_two_ranks(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--dtype", "bfloat16", "--autocast", *SHORT, "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 3
    # A fresh byte-level model starts near ln(256) = 5.5, in bfloat16 too.
    assert 4.5 < metrics["loss_first"] < 6.5
    assert metrics["precision"] == "bfloat16 autocast, float32 parameters"
    assert "- precision: bfloat16 autocast, float32 parameters" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--autocast"], "--autocast computes in a lower precision than the float32 parameters"),
        (["--dtype", "float64", "--autocast"], "(got --dtype float64)"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ],
)
def test_a_dtype_mistake_is_one_line_and_exit_2(argv, named, tmp_path, capsys):
    assert main(["train", *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "run").exists()


def test_a_device_without_autocast_is_refused_naming_the_options():
    meta = torch.device("meta")
    with pytest.raises(OptionError, match=r"^--dtype bfloat16 --autocast: .*'meta'"):
        check_dtype(TrainConfig(dtype="bfloat16", autocast=True), meta)
    check_dtype(TrainConfig(dtype="bfloat16", autocast=True), torch.device("cpu"))
    check_dtype(TrainConfig(dtype="float16"), torch.device("cpu"))


def test_the_config_file_takes_autocast_and_names_the_key(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('dtype = "float32"\nautocast = true\n')
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    assert f"{path}, key autocast: --autocast computes" in capsys.readouterr().err
