"""A `twobp train` run into an ``--out`` that holds another run's checkpoints.

A run writes three checkpoints; a new run into the same folder is refused in
one line before any rank starts and leaves them as they were; ``--overwrite``
replaces them. Which checkpoints a run continues (``--resume``) decides which
it may replace, checked on copies of the real checkpoints.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from twobp.cli.main import main
from twobp.config import read_toml
from twobp.train.config import TrainConfig
from twobp.train.out_folder import delete_foreign_checkpoints
from twobp.train.preflight import OptionError, check_config

OPTIONS = [
    "--batch-size", "4", "--microbatches", "2", "--seq-len", "16", "--threads", "1",
    "--timeout", "30",
]  # fmt: skip
STEPS = ["step-00000001", "step-00000002", "step-00000003"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """The output folder of a run with checkpoints at steps 1, 2 and 3."""
    out = tmp_path_factory.mktemp("runs") / "first"
    args = [*OPTIONS, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "3"]
    assert main(["train", *args, "--out", str(out)]) == 0
    return out


def _contents(out: Path) -> dict[str, bytes]:
    """Every file of the checkpoints, with its bytes."""
    root = out / "checkpoints"
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _copy(first_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(first_run / "checkpoints", out / "checkpoints")
    return out


def _steps_in(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_a_new_run_into_a_folder_with_checkpoints_is_refused_in_one_line(
    first_run, tmp_path, capsys
):
    out = _copy(first_run, tmp_path)
    before = _contents(out)
    assert main(["train", "--steps", "2", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"twobp train: error: --out {out} holds checkpoints of another run (3 checkpoints, "
        f"steps 1 to 3, in {out}/checkpoints); continue it with --resume {out}, replace them "
        "with --overwrite, or give another --out\n"
    )
    assert _contents(out) == before
    assert not (out / "config.toml").exists()  # refused before anything was written


def test_overwrite_replaces_the_checkpoints_of_another_run(first_run, tmp_path, capsys):
    out = _copy(first_run, tmp_path)
    args = [*OPTIONS, "--steps", "2", "--keep-checkpoints", "3", "--overwrite", "--out", str(out)]
    assert main(["train", *args]) == 0
    # Not step 1 of the other run too, as rotation alone would keep.
    assert _steps_in(out) == ["step-00000002"]
    assert _contents(out) != _contents(first_run)
    # The folder is this run's now: repeating its options asks again.
    assert "overwrite" not in read_toml(TrainConfig, out / "config.toml")
    with pytest.raises(OptionError, match="holds checkpoints of another run"):
        check_config(TrainConfig(steps=2, out=str(out)))
    capsys.readouterr()


def _cfg(out: Path, **options) -> TrainConfig:
    return TrainConfig(steps=10, seq_len=16, out=str(out), **options)


def test_a_run_continuing_the_latest_checkpoint_may_replace_the_others(first_run, tmp_path):
    out = _copy(first_run, tmp_path)
    for resume in (str(out), "auto", str(out / "checkpoints" / STEPS[2])):
        check_config(_cfg(out, resume=resume))
        assert delete_foreign_checkpoints(_cfg(out, resume=resume, overwrite=True)) == []
    assert _steps_in(out) == STEPS
    check_config(_cfg(tmp_path / "new"))
    check_config(_cfg(tmp_path / "new", resume=str(out)))  # from another folder into a new one


def test_resuming_an_earlier_checkpoint_would_replace_the_later_ones(first_run, tmp_path):
    out = _copy(first_run, tmp_path)
    earlier = out / "checkpoints" / STEPS[0]
    with pytest.raises(OptionError) as refused:
        check_config(_cfg(out, resume=str(earlier)))
    assert str(refused.value) == (
        f"--resume {earlier}: {out}/checkpoints holds later checkpoints (2 checkpoints, steps 2 "
        f"to 3) that this run would replace; resume from the latest with --resume {out}, "
        "replace them with --overwrite, or give another --out"
    )
    assert _steps_in(out) == STEPS
    deleted = delete_foreign_checkpoints(_cfg(out, resume=str(earlier), overwrite=True))
    assert sorted(p.name for p in deleted) == STEPS[1:] and _steps_in(out) == STEPS[:1]


def test_resuming_another_run_into_a_folder_with_checkpoints_is_refused(first_run, tmp_path):
    out = _copy(first_run, tmp_path)
    other = first_run / "checkpoints" / STEPS[1]
    with pytest.raises(OptionError, match=f"--out {out} holds checkpoints of another run"):
        check_config(_cfg(out, resume=str(other)))
    assert delete_foreign_checkpoints(_cfg(out, resume=str(other))) == []  # not without asking
    delete_foreign_checkpoints(_cfg(out, resume=str(other), overwrite=True))
    assert _steps_in(out) == []


def test_a_folder_with_only_a_crashed_save_s_leftover_is_free(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / ".partial-step-00000004").mkdir(parents=True)  # no manifest
    check_config(_cfg(out))


def test_damaged_later_checkpoints_do_not_hold_a_resume_back(first_run, tmp_path, capsys):
    out = _copy(first_run, tmp_path)
    data = next((out / "checkpoints" / STEPS[2]).glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # truncated: step 3 cannot be continued
    check_config(_cfg(out, resume=str(out / "checkpoints" / STEPS[1])))
    check_config(_cfg(out, resume="auto"))  # passes over step 3 to step 2, with a warning
    assert "warning:" in capsys.readouterr().err


def test_the_main_job_runs_again_into_a_folder_of_its_own(tmp_path, monkeypatch, capsys):
    # `make run` twice: the default --out gives each run its own folder under runs/, and
    # runs/latest leads to the newest; the first run's checkpoint stays.
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = [*OPTIONS, "--steps", "1", "--ranks", "1"]
    assert main(["train", *args]) == 0
    first = (tmp_path / "runs" / "latest").resolve()
    assert main(["train", *args]) == 0
    second = (tmp_path / "runs" / "latest").resolve()
    assert first != second and first.parent == second.parent == tmp_path / "runs"
    assert (first / "checkpoints" / "step-00000001").is_dir()
    assert (second / "checkpoints" / "step-00000001").is_dir()
    assert f"report in runs/{second.name}/report.md" in capsys.readouterr().out


def test_a_folder_left_at_runs_latest_keeps_its_old_meaning(tmp_path, monkeypatch):
    from twobp.train.out_folder import with_run_folder

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "latest").mkdir(parents=True)
    cfg = TrainConfig()
    assert with_run_folder(cfg) is cfg
    assert with_run_folder(TrainConfig(out="elsewhere")).out == "elsewhere"
    assert with_run_folder(TrainConfig(resume="auto")).out == "runs/latest"
