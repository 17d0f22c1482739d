"""`twobp train` end to end: real ranks, real text, real report files."""

import dataclasses
import functools
import io
import json
from types import SimpleNamespace

import pytest
import torch

import twobp.train.run
from reliability_train_script import kill_once
from twobp.cli.main import main
from twobp.config import read_toml
from twobp.runtime.errors import PipelineConfigError
from twobp.train.config import TrainConfig
from twobp.train.data import ByteLMData
from twobp.train.loop import RankResult, learning_rate, own_part
from twobp.train.preflight import check_config
from twobp.train.progress import Progress
from twobp.train.report import memory_line, summarize, throughput


def test_train_two_ranks_writes_report_and_loss_falls(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "train", "--steps", "40", "--batch-size", "8", "--microbatches", "4",
            "--seq-len", "32", "--lr", "5e-3", "--warmup", "5", "--threads", "1",
            "--timeout", "60", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    for name in ("report.md", "metrics.json", "loss.png", "timeline.png", "trace.json"):
        assert (out / name).stat().st_size > 0, name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 40
    assert metrics["loss_last"] < metrics["loss_first"] - 0.5
    assert set(metrics["bubble_ratio_per_rank"]) == {"0", "1"}
    assert all(0.0 <= b < 1.0 for b in metrics["bubble_ratio_per_rank"].values())
    printed = capsys.readouterr()
    assert "samples/s" in printed.out
    # two_bp unset: the stages that split were chosen by a profile, and the run says so.
    choice = metrics["ran"]["two_bp_choice"]
    assert choice.startswith("2BP on ")
    assert metrics["ran"]["two_bp"] == (not choice.startswith("2BP on no stage:"))
    assert f"chosen by a profile (two_bp unset): {choice}" in (out / "report.md").read_text()


def _one_process_losses(argv: list[str]) -> list[float]:
    """The losses of the run ``argv`` describes, as plain PyTorch on one process trains it:
    the same model, batches, learning rates, clipping and AdamW."""
    from twobp.cli.main import build_parser
    from twobp.cli.train import train_config
    from twobp.train.task import build_task

    cfg = train_config(build_parser().parse_args(argv))[0]
    task = build_task(cfg)
    model = torch.nn.Sequential(*task.spec.blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        inputs, targets = task.batch_at(step, "train")
        loss = task.spec.loss_fn(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_train_two_copies_of_a_chimera_pipeline_with_a_sharded_optimizer(
    tmp_path, torch_one_thread
):
    out = tmp_path / "run"
    argv = [
        "train", "--ranks", "4", "--data-parallel", "2", "--schedule", "chimera",
        "--steps", "3", "--batch-size", "16", "--microbatches", "4", "--seq-len", "16",
        "--dtype", "float64", "--threads", "1", "--timeout", "60", "--out", str(out),
        "--shard-optimizer",
    ]  # fmt: skip
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 3
    written = (out / "config.toml").read_text()
    assert "seq_len = 16" in written
    assert set(metrics["bubble_ratio_per_rank"]) == {"0", "1", "2", "3"}
    # 2 copies x 2 pipelines, every stage on 4 ranks, AdamW's state sharded over the 4:
    # the losses of one process with a plain AdamW.
    want = _one_process_losses(argv)
    assert metrics["losses"] == pytest.approx(want, rel=0, abs=1e-10)


def test_train_with_recompute_reports_memory(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "train", "--steps", "3", "--batch-size", "8", "--microbatches", "4",
            "--seq-len", "16", "--threads", "1", "--timeout", "60", "--out", str(out),
            "--recompute", "all", "--weight-group-size", "2", "--no-save",
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "memory (MiB; activations, stash, parameters, optimizer, peak): rank 0 " in printed
    memory = json.loads((out / "metrics.json").read_text())["memory_per_rank"]
    for figures in memory.values():
        assert set(figures) == {"activations", "stash", "parameters", "optimizer", "peak"}
        assert figures["optimizer"] > 0 and figures["peak"] > figures["parameters"]
    assert (
        "| rank | activations | stash | parameters | optimizer | peak |"
        in (out / "report.md").read_text()
    )


def test_a_rank_that_fails_makes_twobp_train_exit_1(tmp_path, monkeypatch):
    # Rank 1 is killed (SIGKILL) before its first step; rank 0 then fails on its peer.
    monkeypatch.setenv("KILL_AT", "0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(
        twobp.train.run,
        "run_training",
        functools.partial(twobp.train.run.run_training, on_step=kill_once),
    )
    code = main(
        [
            "train", "--steps", "3", "--batch-size", "4", "--microbatches", "2",
            "--seq-len", "16", "--threads", "1", "--timeout", "30",
            "--out", str(tmp_path / "run"),
        ]
    )  # fmt: skip
    assert code == 1


def test_bad_batch_size_is_refused_before_any_rank_starts(capsys):
    assert main(["train", "--batch-size", "3", "--microbatches", "4"]) == 2
    assert "--batch-size 3 holds fewer samples than 4" in capsys.readouterr().err


def test_learning_rate_warms_up_then_decays():
    cfg = TrainConfig(lr=1.0, warmup=10, steps=110)
    assert learning_rate(0, cfg) == pytest.approx(0.1)
    assert learning_rate(9, cfg) == pytest.approx(1.0)
    assert learning_rate(109, cfg) == pytest.approx(0.1, abs=1e-3)


def test_check_config_names_the_option():
    with pytest.raises(ValueError, match="--steps"):
        check_config(TrainConfig(steps=0))


def test_a_memory_limit_is_checked_and_needs_schedule_auto(tmp_path):
    out = str(tmp_path / "run")
    check_config(TrainConfig(schedule="auto", memory_limit="2GiB", out=out))
    with pytest.raises(ValueError, match="--memory-limit bounds the choice of --schedule auto"):
        check_config(TrainConfig(memory_limit="2GiB", out=out))
    check_config(TrainConfig(recompute="auto", memory_limit="2GiB", out=out))
    with pytest.raises(ValueError, match=r"--recompute auto rebuilds only .* give --memory-limit"):
        check_config(TrainConfig(recompute="auto", out=out))
    with pytest.raises(ValueError, match="--memory-limit lots: cannot read"):
        check_config(TrainConfig(schedule="auto", memory_limit="lots", out=out))
    with pytest.raises(ValueError, match=r"--memory-limit 1KiB: no schedule fits.*at least"):
        check_config(TrainConfig(schedule="auto", memory_limit="1KiB", out=out))
    with pytest.raises(ValueError, match="--auto-trials must be >= 0, got -1"):
        check_config(TrainConfig(schedule="auto", auto_trials=-1, out=out))


def test_images_are_counted_in_samples_only():
    result = RankResult(rank=0, losses=[2.0, 1.0], step_seconds=[0.5, 0.5])
    summary = summarize(TrainConfig(model="resnet", batch_size=16), [result])
    assert summary["tokens_per_s"] is None
    assert throughput(summary) == "32.0 samples/s"
    text = throughput(summarize(TrainConfig(), [dataclasses.replace(result, tokens_per_sample=64)]))
    assert text == "32.0 samples/s, 2048 tokens/s"
    stream = io.StringIO()
    Progress(1, stream=stream).update(1, 1.0, 32.0, None)
    assert "32.0 samples/s" in stream.getvalue() and "tokens/s" not in stream.getvalue()


def test_a_text_too_short_to_hold_out_a_sequence_is_refused_before_any_rank_starts(tmp_path):
    # Long enough to train on, but its held-out twentieth is shorter than one sequence.
    short = tmp_path / "short.txt"
    short.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"--data .* has 1,024 bytes; sequences of 64 bytes need"):
        check_config(TrainConfig(data=str(short), seq_len=64, out=str(tmp_path / "run")))
    need = ByteLMData.min_bytes(64)
    data = ByteLMData.from_bytes(bytes(need), 64, "text")
    assert data.batch(0, 4, 0, split="eval")[0].shape == (4, 64)
    with pytest.raises(ValueError, match="too short"):
        ByteLMData.from_bytes(bytes(need - 1), 64, "text")


def test_each_data_parallel_copy_takes_its_rows_and_a_too_small_batch_is_refused():
    ids = torch.arange(6).reshape(6, 1)
    batch = ((ids, ids + 10), ids + 20)
    copy = SimpleNamespace(dp_size=3, dp_rank=1)
    (inputs, mask), targets = own_part(copy, batch)
    assert inputs.flatten().tolist() == [2, 3] and mask.flatten().tolist() == [12, 13]
    assert targets.flatten().tolist() == [22, 23]
    assert own_part(SimpleNamespace(dp_size=1, dp_rank=0), batch) is batch
    # 6 rows over 4 copies: 2, 2, 1 and 1, as torch.tensor_split cuts them.
    (inputs, _), _ = own_part(SimpleNamespace(dp_size=4, dp_rank=3), batch)
    assert inputs.flatten().tolist() == [5]
    with pytest.raises(PipelineConfigError, match="batch size 6, fewer rows than the 7"):
        own_part(SimpleNamespace(dp_size=7, dp_rank=0), batch)


def test_the_printed_memory_line_gives_every_figure_in_mib():
    mib = 1024 * 1024
    memory = {0: {"activations": 3 * mib // 2, "peak": 5 * mib}, 1: {"stash": mib // 4}}
    assert memory_line(memory) == (
        "memory (MiB; activations, stash, parameters, optimizer, peak): "
        "rank 0 1.5, 0.0, 0.0, 0.0, 5.0; rank 1 0.0, 0.2, 0.0, 0.0, 0.0"
    )
    assert memory_line({0: {}, 1: {}}) is None


def test_a_nonfinite_loss_names_the_step_as_the_progress_line_counts():
    from twobp.runtime.errors import nonfinite_error

    message = str(nonfinite_error(0, 3, float("nan"), 1, 1))
    assert "the mean loss of step 4 (step_count 3) is nan" in message


def test_train_a_tensor_parallel_pipeline_equals_one_process(tmp_path, torch_one_thread, capfd):
    out = tmp_path / "run"
    argv = [
        "train", "--ranks", "4", "--tensor-parallel", "2", "--schedule", "zb-h1",
        "--steps", "3", "--batch-size", "8", "--microbatches", "4", "--seq-len", "16",
        "--dtype", "float64", "--threads", "1", "--timeout", "60", "--out", str(out),
        "--log-every", "1",
    ]  # fmt: skip
    assert main(argv) == 0
    assert list((out / "checkpoints").iterdir())  # each rank's shards, none joined
    metrics = json.loads((out / "metrics.json").read_text())
    # 2 pipeline ranks x 2 tensor-parallel ranks, clipped by the norm over all four.
    assert metrics["losses"] == pytest.approx(_one_process_losses(argv), rel=0, abs=1e-10)
    captured = capfd.readouterr()
    assert (captured.out + captured.err).count("step 3/3") == 1  # one rank reports
    # Two copies of a one-stage pipeline, parameters sharded over them: the same losses.
    sharded = [*argv, "--data-parallel", "2", "--shard-parameters", "--overwrite"]
    assert main(sharded) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["losses"] == pytest.approx(_one_process_losses(argv), rel=0, abs=1e-10)


def test_train_chooses_the_tensor_parallel_size_of_a_range(tmp_path, torch_one_thread, capfd):
    # 2 ranks: T 1 (P 2) or T 2 (P 1), both profiled and simulated, the fastest runs.
    out = tmp_path / "run"
    argv = [
        "train", "--ranks", "2", "--tensor-parallel", "1,2", "--schedule", "auto",
        "--steps", "2", "--batch-size", "8", "--microbatches", "4", "--seq-len", "16",
        "--dtype", "float64", "--threads", "1", "--timeout", "60", "--out", str(out),
        "--no-save",
    ]  # fmt: skip
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["losses"] == pytest.approx(_one_process_losses(argv), rel=0, abs=1e-10)
    printed = capfd.readouterr()
    assert "the fastest simulated of T=1 (P=2)" in printed.out + printed.err
    assert "tensor_parallel = [1, 2]" in (out / "config.toml").read_text()
    assert read_toml(TrainConfig, out / "config.toml")["tensor_parallel"] == [1, 2]
    assert main([*argv, "--schedule", "zb-h1", "--overwrite"]) == 2
    assert "does not take a schedule by name" in capfd.readouterr().err


def test_train_chimera_with_its_parameters_sharded_over_its_two_pipelines(
    tmp_path, torch_one_thread
):
    # One copy: Chimera holds each stage on both ranks, which shard it between them.
    out = tmp_path / "run"
    argv = [
        "train", "--ranks", "2", "--schedule", "chimera", "--shard-parameters",
        "--steps", "3", "--batch-size", "8", "--microbatches", "4", "--seq-len", "16",
        "--dtype", "float64", "--threads", "1", "--timeout", "60", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["losses"] == pytest.approx(_one_process_losses(argv), rel=0, abs=1e-10)
    assert list((out / "checkpoints").iterdir())
    resumed = [*argv[:-2], "--out", str(tmp_path / "again"), "--steps", "4", "--resume", str(out)]
    assert main(resumed) == 0
