"""Checkpoints of a pipeline: save, load into any layout, merge, and survive a crash mid-save.

One launch of 2 ranks saves the conv model (BatchNorm buffers, AdamW state) in
torch.distributed.checkpoint format, loads it into the same layout (the
continuation is bitwise identical) and into another schedule and partition
(equal to 1e-10 in float64), loads a checkpoint that one process wrote, writes
one in the background while training on, fails to load broken checkpoints on
every rank, and ends with rank 1 killed in the middle of writing its data. The
rest runs here, in a world of one process: the 2-rank checkpoint loads into it,
merges into one state dict, reads with DCP's own functions, and nothing in a
checkpoint is unpickled.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from reliability_workers import BATCH, checkpoint_session, conv, train_steps
from runtime_models import build_blocks, make_batch, needs_no_process_group, one_thread
from twobp.cli.checkpoint import main as checkpoint_cli
from twobp.runtime import LaunchError, launch
from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint import is_checkpoint, latest_checkpoint, merge, read_manifest
from twobp.runtime.state.checkpoint.integrity import crc32
from twobp.runtime.state.checkpoint.storage import tensor_shapes
from twobp.runtime.state.optimizer_and_rng import (
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    parameter_names,
    rng_state,
)

TOL = 1e-10

pytestmark = [needs_no_process_group, pytest.mark.usefixtures("torch_one_thread")]


def _single_process_reference(folder: Path) -> dict[str, Any]:
    """Two steps in one process, a checkpoint, then two more steps."""
    pipe = conv(5.0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    train_steps(pipe, optimizer, range(2))
    pipe.save(folder / "single", optimizer, extra={"rank": 0, "position": 2})
    losses = train_steps(pipe, optimizer, range(2, 4))
    return {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()}}


@pytest.fixture(scope="module")
def single(session) -> dict[str, Any]:
    return session[3]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, list[float], dict[str, torch.Tensor]]:
    """A conv checkpoint saved by one process after 2 steps; its next 2 losses and state."""
    path = tmp_path_factory.mktemp("one-process") / "ckpt"
    pipe = conv(5.0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    train_steps(pipe, optimizer, range(2))
    pipe.save(path, optimizer, extra={"saved by": "one process"})
    losses = train_steps(pipe, optimizer, range(2, 4))
    return path, losses, {k: v.clone() for k, v in pipe.state_dict().items()}


@pytest.fixture(scope="module")
def session(
    tmp_path_factory, one_process
) -> tuple[Path, list[dict[str, Any]], LaunchError, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("checkpoints")
    with one_thread():
        single = _single_process_reference(folder)
    with pytest.raises(LaunchError) as info:
        launch(
            checkpoint_session, 2, str(folder), 30.0, str(one_process[0]), threads_per_rank=1,
            grace_period=5.0, timeout=180,
        )  # fmt: skip
    outcomes = [pickle.loads((folder / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    return folder, outcomes, info.value, single


def _union(outcomes: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for out in outcomes:
        assert not set(merged) & set(out[key]), "a tensor on two ranks"
        merged.update(out[key])
    return merged


def test_layout_of_a_checkpoint(session):
    folder, outcomes, *_ = session
    path = Path(outcomes[0]["saved path"])
    assert path == folder / "ckpt" / "step-00000002"
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
    ]
    manifest = read_manifest(folder / "ckpt")
    assert manifest["step"] == 2 and manifest["world_size"] == 2
    assert manifest["storage"] == "torch.distributed.checkpoint" and manifest["version"] == 2
    assert manifest["stage_blocks"] == [[0, 5], [5, 10]] and manifest["placement"] == [0, 1]
    assert manifest["optimizer"] == "AdamW" and manifest["meta"] == {"note": "hi"}
    state = _union(outcomes, "saved state")
    assert list(manifest["tensors"]) == list(nn.Sequential(*build_blocks("conv")).state_dict())
    for name, tensor in state.items():
        assert manifest["tensors"][name]["shape"] == list(tensor.shape)
    assert manifest["tensors"]["0.1.running_mean"]["rank"] == 0
    assert manifest["tensors"]["9.weight"]["rank"] == 1
    assert [r["extra"] for r in manifest["ranks"]] == [
        {"rank": 0, "position": 2},
        {"rank": 1, "position": 2},
    ]
    # Every tensor in DCP under its single-process name; the rest is JSON in the manifest.
    stored = tensor_shapes(path)
    assert {n.removeprefix("model.") for n in stored if n.startswith("model.")} == set(state)
    assert "optimizer.state.9.weight.exp_avg" in stored and "rng.1.torch" in stored
    groups = manifest["ranks"][1]["optimizer"]["param_groups"]
    assert groups[0]["lr"] == 1e-2 and groups[0]["betas"] == {"tuple": [0.9, 0.999]}
    # Each rank recorded the files it wrote; rank 0 the metadata too.
    assert manifest["files"] == {
        name: {"bytes": (path / name).stat().st_size, "crc32": crc32(path / name)}
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp")
    }


def test_same_layout_resumes_bitwise(session):
    _, outcomes, *_ = session
    for rank, out in enumerate(outcomes):
        assert out["extra"] == {"rank": rank, "position": 2}
        assert out["step count"] == 2
        assert out["same layout losses"] == out["continued losses"]
        for name, want in out["continued state"].items():
            assert torch.equal(out["same layout state"][name], want), name


def test_another_schedule_and_partition_loads_by_name(session):
    _, outcomes, *_ = session
    want = _union(outcomes, "continued state")
    got = _union(outcomes, "repartitioned state")
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=TOL, msg=name)
    for out in outcomes:
        for a, b in zip(out["repartitioned losses"], out["continued losses"], strict=True):
            assert abs(a - b) < TOL


@pytest.mark.parametrize(
    ("case", "text"),
    [
        ("other model", "does not fit this model ("),
        ("missing", "nothing-here does not exist"),
        ("optimizer class", "holds the state of a AdamW, not of a SGD"),
        ("foreign parameter", "the optimizer holds a parameter of shape [3]"),
        ("file of rank 1 missing", "broken/__1_0.distcp is missing"),
        ("truncated", "damaged/step-00000002/__1_0.distcp is truncated: "),
        ("altered", "altered/__1_0.distcp is damaged: its CRC-32 is "),
    ],
)
def test_a_bad_checkpoint_fails_on_every_rank(session, case, text):
    _, outcomes, *_ = session
    for rank, out in enumerate(outcomes):
        assert out[case] is not None, (rank, case)
        name, message = out[case]
        assert name == "CheckpointError" and text in message, (rank, message)
    assert "0.0.weight is [8, 8] here but [4, 3, 3, 3]" in outcomes[0]["other model"][1]
    assert all(out["unchanged after failed load"] for out in outcomes)


def test_a_damaged_checkpoint_names_the_previous_intact_one(session):
    folder, outcomes, *_ = session
    previous = folder / "damaged" / "step-00000001"
    for out in outcomes:
        assert out["truncated"][1].endswith(f"; the previous intact checkpoint is {previous}")
    # The ranks split the CRC-32s: rank 0 read rank 1's file, and told rank 1.
    assert outcomes[1]["altered"][1].startswith("rank 0 reported: ")
    assert "when saved (the file changed since)" in outcomes[1]["altered"][1]


def test_a_crash_during_a_save_leaves_the_previous_checkpoint(session):
    folder, outcomes, error, _ = session
    killed, waiting = error.failures
    assert killed.rank == 1 and killed.message == "killed by SIGKILL"
    assert waiting.rank == 0 and waiting.error_type == "PeerFailedError"
    assert "writing a checkpoint" in waiting.message
    root = folder / "crash"
    partial = root / ".partial-step-00000002"
    assert partial.is_dir() and not is_checkpoint(partial)
    assert (partial / "__1_0.distcp").read_bytes() == b"half a file"
    assert latest_checkpoint(root) == root / "step-00000001"
    # The previous checkpoint loads, here in a world of one process.
    pipe = conv(5.0)
    optimizer = torch.optim.AdamW(pipe.parameters())
    pipe.load(root, optimizer)
    want = _union(outcomes, "crash state")
    for name, tensor in pipe.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    # The next save completes and clears what the crash left.
    pipe.save(root, optimizer)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    pipe.save(root, optimizer, step=3)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]


def test_a_one_process_checkpoint_loads_onto_two_ranks_and_trains_on(session, one_process):
    _, outcomes, _, _ = session
    _, want_losses, want_state = one_process
    for rank, out in enumerate(outcomes):
        assert out["from one stages"] == [rank]
        assert out["from one extra"] == {"saved by": "one process"}
        for a, b in zip(out["from one losses"], want_losses, strict=True):
            assert abs(a - b) < TOL, (rank, a, b)
    got = _union(outcomes, "from one state")
    assert set(got) == set(want_state)
    for name, tensor in want_state.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=TOL, msg=name)


def test_each_rank_resumes_its_own_random_stream_bitwise(session):
    # Dropout on both ranks, each rank seeded apart: the resumed run draws the same
    # masks as the run that went on after saving, on each rank.
    _, outcomes, _, _ = session
    for out in outcomes:
        dropout = out["dropout"]
        assert dropout["resumed losses"] == dropout["continued losses"]
        for name, want in dropout["continued state"].items():
            assert torch.equal(dropout["resumed state"][name], want), name


def test_a_two_rank_checkpoint_loads_into_one_process_and_trains_on(session):
    folder, outcomes, *_ = session
    pipe = conv(5.0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.5)
    # Fewer ranks than saved: each rank gets rank 0's extra.
    assert pipe.load(folder / "ckpt", optimizer) == {"rank": 0, "position": 2}
    losses = train_steps(pipe, optimizer, range(2, 4))
    want = _union(outcomes, "continued state")
    for name, tensor in pipe.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=TOL, msg=name)
    for a, b in zip(losses, outcomes[0]["continued losses"], strict=True):
        assert abs(a - b) < TOL


def test_a_checkpoint_written_in_the_background_holds_the_state_when_saved(session):
    folder, outcomes, *_ = session
    for out in outcomes:
        assert out["async waited"] == out["async path"] == str(folder / "async" / "step-00000007")
        assert out["nothing to wait for"] is None
    merged = merge(folder / "async")  # its files checked against what rank 0 recorded
    assert sorted(read_manifest(folder / "async")["files"]) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    want = _union(outcomes, "async state")
    assert set(merged) == set(want)
    assert all(torch.equal(merged[k], want[k]) for k in want)


def test_a_background_save_copies_the_state_before_the_next_step_changes_it(session):
    # The write waited (in DCP's thread) until after the next optimizer step: a save that
    # wrote the live tensors instead of a copy would hold the weights after that step.
    folder, outcomes, *_ = session
    for out in outcomes:
        # (DCP's thread reaches the write before or after the step; either way it waits.)
        events = out["held events"]
        assert "write waits" in events and "never released" not in events, events
        assert events.index("save returned") < events.index("stepped"), events
        assert out["held waited"] == out["held path"] == str(folder / "held" / "step-00000008")
    merged = merge(folder / "held")
    want = _union(outcomes, "held state")
    assert set(merged) == set(want)
    after = _union(outcomes, "held after step")
    assert any(not torch.equal(want[k], after[k]) for k in want)
    for name, tensor in want.items():
        assert torch.equal(merged[name], tensor), name


def test_a_failed_background_save_is_reported_by_the_next_wait_or_save(session):
    folder, outcomes, *_ = session
    # Rank 1's write failed in DCP's thread; every rank hears of it, once.
    said = "rank 1 cannot write its part of the checkpoint: OSError: [Errno 28] No space left"
    for out in outcomes:
        for key in ("failed write, next wait", "failed write, next save"):
            name, message = out[key]
            assert name == "CheckpointError" and said in message, (key, message)
        assert out["failed write, wait again"] is None
    # Nothing incomplete is ever loaded: no checkpoint came out of the failed writes.
    assert latest_checkpoint(folder / "failing") is None
    assert not [p for p in (folder / "failing").iterdir() if is_checkpoint(p)]


def test_a_one_process_checkpoint_loads_into_two_ranks(session, single):
    _, outcomes, *_ = session
    got = _union(outcomes, "from one process state")
    assert set(got) == set(single["state"])
    for name, want in single["state"].items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=TOL, msg=name)
    for out in outcomes:
        assert out["from one process extra"] == {"rank": 0, "position": 2}
        for a, b in zip(out["from one process losses"], single["losses"], strict=True):
            assert abs(a - b) < TOL


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reads_a_checkpoint_without_twobp(session, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, outcomes, *_ = session
    path = folder / "ckpt" / "step-00000002"
    want = _union(outcomes, "saved state")
    state = {"model.9.weight": torch.zeros_like(want["9.weight"])}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert torch.equal(state["model.9.weight"], want["9.weight"])
    dcp_to_torch_save(path, tmp_path / "all.pt")
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert torch.equal(everything["model.0.1.running_mean"], want["0.1.running_mean"])


def test_merge_gives_the_single_process_state_dict(session, tmp_path, capsys):
    folder, outcomes, *_ = session
    merged = merge(folder / "ckpt")
    want = _union(outcomes, "saved state")
    assert list(merged) == list(nn.Sequential(*build_blocks("conv")).state_dict())
    assert all(torch.equal(merged[k], want[k]) for k in want)
    model = nn.Sequential(*build_blocks("conv"))
    model.load_state_dict(merged)
    # ... and back: a single-process state dict loads into a pipeline.
    pipe = conv(5.0)
    pipe.load_state_dict(model.state_dict())
    inputs, _ = make_batch("conv", 0, BATCH)
    model.eval()
    pipe.eval()
    torch.testing.assert_close(pipe.eval_step(inputs), model(inputs), rtol=0, atol=TOL)
    out = tmp_path / "merged.pt"
    assert checkpoint_cli(["merge", str(folder / "ckpt"), str(out)]) == 0
    assert set(torch.load(out)) == set(merged)
    assert checkpoint_cli(["info", str(folder / "ckpt")]) == 0
    printed = capsys.readouterr().out
    assert "step 2" in printed and "blocks per stage: 0-4, 5-9" in printed
    assert "2 pipeline ranks, schedule" in printed
    assert checkpoint_cli(["info", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- in one process --------------------------------------------------------------------


def test_keep_and_a_rolled_back_run(tmp_path):
    pipe = conv(5.0)
    optimizer = torch.optim.AdamW(pipe.parameters())
    for step in (1, 2, 3):
        pipe.save(tmp_path, optimizer, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    # Saving an earlier step (a run resumed from an older checkpoint) drops the later ones.
    pipe.save(tmp_path, optimizer, step=2, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    with pytest.raises(CheckpointError, match="keep=0"):
        pipe.save(tmp_path, keep=0)


def test_a_crash_between_the_renames_is_found(tmp_path):
    pipe = conv(5.0)
    pipe.save(tmp_path, step=4)
    # As if a crash came after the old step-4 moved aside, before the new one moved in.
    (tmp_path / "step-00000004").rename(tmp_path / ".replaced-step-00000004")
    assert latest_checkpoint(tmp_path) == tmp_path / ".replaced-step-00000004"
    manifest = json.loads((tmp_path / ".replaced-step-00000004" / "manifest.json").read_text())
    assert manifest["step"] == 4


def test_load_restores_rng_and_step(tmp_path):
    pipe = conv(5.0)
    torch.manual_seed(7)
    pipe.save(tmp_path, extra="x")
    expected = torch.rand(3)
    other = conv(5.0)
    assert other.load(tmp_path) == "x"
    assert torch.equal(torch.rand(3), expected)
    assert other.step_count == 0


def test_optimizer_state_by_name_survives_other_groups():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    names = parameter_names(model.named_parameters())
    first = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters()}], lr=0.2
    )
    model(torch.ones(1, 2)).sum().backward()
    first.step()
    saved = optimizer_state_by_name(first, names)
    assert set(saved["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    # Another order, another grouping: every parameter finds its state and its group's lr.
    second = torch.optim.AdamW([*model[1].parameters(), *model[0].parameters()], lr=0.9)
    load_optimizer_state_by_name(second, names, [saved])
    state = second.state_dict()
    assert torch.equal(state["state"][0]["exp_avg"], saved["state"]["1.weight"]["exp_avg"])
    assert second.param_groups[0]["lr"] == 0.2


# -- nothing in a checkpoint is unpickled ----------------------------------------------


class _MakesAFolder:
    """Unpickling it would create a folder: the proof that a loader ran its code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.marker),))


def test_extra_is_json_data_only(tmp_path):
    pipe = conv(5.0)
    pipe.save(tmp_path / "ok", extra={"losses": [1.5, float("nan")], "pair": (1, 2), "n": None})
    extra = conv(5.0).load(tmp_path / "ok")
    assert extra["pair"] == [1, 2] and extra["losses"][0] == 1.5 and extra["n"] is None
    with pytest.raises(CheckpointError, match=r"extra\['a'\]\[1\] is a object: a checkpoint"):
        pipe.save(tmp_path / "bad", extra={"a": [1, object()]})
    with pytest.raises(CheckpointError, match=r"extra has the key 3, not a string"):
        pipe.save(tmp_path / "bad", extra={3: "x"})
    assert latest_checkpoint(tmp_path / "bad") is None


def test_dcp_metadata_with_other_objects_is_refused(tmp_path):
    pipe = conv(5.0)
    path = pipe.save(tmp_path)
    marker = tmp_path / "unpickled"
    (path / ".metadata").write_bytes(pickle.dumps(_MakesAFolder(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata is truncated: [\d,]+ bytes of the"):
        conv(5.0).load(tmp_path)
    # Without the sizes of its files in the manifest (as twobp wrote it before), the
    # metadata is unpickled, through the allow-list.
    _forget_file_sizes(path)
    with pytest.raises(CheckpointError, match="mkdir is not part of DCP's metadata"):
        conv(5.0).load(tmp_path)
    with pytest.raises(CheckpointError, match="mkdir is not part of DCP's metadata"):
        merge(tmp_path)
    assert not marker.exists()


def _forget_file_sizes(path: Path) -> None:
    """Drop the files' sizes and checksums from a manifest, as twobp wrote it before."""
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_value_that_dcp_pickled_is_not_loaded(tmp_path):
    import torch.distributed.checkpoint as dcp

    pipe = conv(5.0)
    path = pipe.save(tmp_path)
    marker = tmp_path / "unpickled"
    state = {f"model.{k}": v for k, v in pipe.state_dict().items()}
    state["model.0.0.weight"] = _MakesAFolder(marker)  # type: ignore[assignment]
    for name in [p.name for p in path.iterdir() if p.name != "manifest.json"]:
        (path / name).unlink()
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save(state, checkpoint_id=path, no_dist=True)
    _forget_file_sizes(path)  # the files are DCP's own, not those saved
    with pytest.raises(CheckpointError, match=r"its DCP metadata has no model\.0\.0\.weight"):
        conv(5.0).load(tmp_path)
    assert not marker.exists()


# -- the first format ---------------------------------------------------------------------


def _first_format_checkpoint(root: Path, pipe: Any, optimizer: Any, extra: Any) -> Path:
    """A checkpoint as twobp's first format wrote it: a pickle per rank and a manifest."""
    folder = root / "step-00000002"
    folder.mkdir(parents=True)
    payload = {
        "format": 1, "rank": 0, "step": 2, "model": pipe.state_dict(),
        "optimizer": optimizer_state_by_name(optimizer, parameter_names(pipe.named_parameters())),
        "rng": rng_state(torch.device("cpu")), "extra": extra,
    }  # fmt: skip
    torch.save(payload, folder / "rank-00000.pt")
    tensors = {
        n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "file": 0}
        for n, t in pipe.state_dict().items()
    }
    manifest = {
        "format": "twobp-checkpoint", "version": 1, "step": 2, "world_size": 1,
        "schedule": "1f1b", "n_microbatches": 4, "placement": [0], "stage_blocks": [[0, 10]],
        "optimizer": "AdamW", "files": ["rank-00000.pt"], "tensors": tensors, "meta": {},
        "created": "2026-11-30T00:00:00+0000",
    }  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_first_format_is_refused_with_the_command_that_converts_it(tmp_path, capsys):
    pipe = conv(5.0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    train_steps(pipe, optimizer, range(2))
    torch.manual_seed(11)
    old = _first_format_checkpoint(tmp_path / "old", pipe, optimizer, {"position": 2})
    with pytest.raises(
        CheckpointError, match=f"convert it once with `twobp checkpoint convert {old}"
    ):
        conv(5.0).load(old)
    assert checkpoint_cli(["convert", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'new' / 'step-00000002'}"
    fresh = conv(5.0)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    torch.manual_seed(99)
    assert fresh.load(tmp_path / "new", fresh_optimizer) == {"position": 2}
    assert torch.equal(torch.rand(3), (torch.manual_seed(11), torch.rand(3))[1])
    for name, tensor in pipe.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert train_steps(fresh, fresh_optimizer, range(2, 4)) == train_steps(
        pipe, optimizer, range(2, 4)
    )
    # In place: the converted checkpoint replaces the old one.
    assert checkpoint_cli(["convert", str(tmp_path / "old"), str(tmp_path / "old")]) == 0
    assert read_manifest(tmp_path / "old")["version"] == 2
    assert checkpoint_cli(["convert", str(tmp_path / "old"), str(tmp_path / "x")]) == 2
    assert "is of the current format already" in capsys.readouterr().err


def test_a_first_format_extra_with_objects_is_not_converted(tmp_path, capsys):
    pipe = conv(5.0)
    optimizer = torch.optim.AdamW(pipe.parameters())
    marker = tmp_path / "unpickled"
    _first_format_checkpoint(tmp_path / "old", pipe, optimizer, _MakesAFolder(marker))
    assert checkpoint_cli(["convert", str(tmp_path / "old"), str(tmp_path / "new")]) == 2
    assert "holds objects other than tensors and plain data" in capsys.readouterr().err
    assert not marker.exists()
