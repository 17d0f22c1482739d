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
from twobp.train.task import autocast_dtype, build_task, grad_scaler, parameter_dtype

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


SCALED = [
    "--steps", "100", "--batch-size", "2", "--microbatches", "2", "--seq-len", "8",
    "--warmup", "5", "--threads", "1", "--timeout", "120", "--log-every", "100",
]  # fmt: skip


def test_float16_autocast_trains_with_a_dynamic_loss_scale_that_resumes(tmp_path):
    """100 steps on 2 ranks in two runs (50, then --resume to 100): the loss falls as in
    float32, the report gives the scale, and the resumed run goes on counting the scaler's
    steps."""
    f16, f32 = tmp_path / "f16", tmp_path / "f32"
    half = ["--dtype", "float16", "--autocast", *SCALED, "--out", str(f16)]
    assert main(["train", *half, "--stop-after", "50"]) == 0
    assert main(["train", *half, "--resume", "auto"]) == 0
    # The float32 curve, on one rank: the same gradients as the pipeline, at less cost.
    assert main(["train", *SCALED, "--ranks", "1", "--no-save", "--out", str(f32)]) == 0
    scaled = json.loads((f16 / "metrics.json").read_text())
    plain = json.loads((f32 / "metrics.json").read_text())
    assert scaled["steps_run"] == 100 and scaled["resumed_from_step"] == 50
    assert scaled["loss_scale"] == "dynamic"
    state = scaled["loss_scale_state"]
    # The tracker counts steps since the last overflow over both runs, not this run's 50.
    overflows = scaled["overflow_steps"]
    assert state["_growth_tracker"] == 100 - (max(overflows) + 1 if overflows else 0)
    assert state["scale"] == 2.0**16 * 0.5 ** len(overflows)
    assert scaled["loss_first"] - scaled["loss_last"] > 1.0
    assert abs(scaled["loss_last"] - plain["loss_last"]) < 0.05 * plain["loss_last"]
    report = (f16 / "report.md").read_text()
    assert f"dynamic loss scale, {state['scale']:g} at the end" in report
    # What ran names the scaler the pipeline stepped with.
    assert scaled["ran"]["scaler"] == "GradScaler"
    assert "gradient scaler: GradScaler" in report


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--dtype", "bfloat16", "--autocast", "--loss-scale", "dynamic"], "bfloat16 has"),
        (["--dtype", "float16", "--loss-scale", "1024"], "for float16 computation with float32"),
        (["--dtype", "float16", "--autocast", "--loss-scale", "-3"], "--loss-scale -3: give"),
    ],
)
def test_a_loss_scale_that_cannot_apply_is_one_line_and_exit_2(argv, named, tmp_path, capsys):
    assert main(["train", *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err


def test_the_loss_scale_option_builds_the_scaler():
    assert grad_scaler(TrainConfig(dtype="float16", autocast=True)).get_scale() == 2.0**16
    static = grad_scaler(TrainConfig(dtype="float16", autocast=True, loss_scale="128"))
    assert static.get_scale() == 128.0 and static.get_growth_factor() == 1.0
    assert static.get_backoff_factor() == 1.0
    assert grad_scaler(TrainConfig(dtype="float16", autocast=True, loss_scale="off")) is None
    assert grad_scaler(TrainConfig(dtype="bfloat16", autocast=True)) is None
