"""Damaged checkpoints: every part that is broken, truncated, changed or missing is named.

In a world of one process: a folder of two checkpoints of the conv model, the
later one damaged in one way per test. ``Pipeline.load``, ``merge`` and
``twobp checkpoint info`` each raise (or print) a :class:`CheckpointError` that
names the file, what is wrong with it and the previous intact checkpoint; a
failed load changes nothing. Checkpoints saved before the manifest recorded
the files' sizes and CRC-32s still load, and are checked for what is known.
(The same on two ranks, where the ranks split the CRC-32s: see
``test_checkpoint_pipeline.py``; under ``twobp train --resume``:
``test_checkpoint_train.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reliability_workers import conv, train_steps
from runtime_models import needs_no_process_group
from twobp.cli.checkpoint import main as checkpoint_cli
from twobp.runtime.errors import CheckpointError
from twobp.runtime.state.checkpoint import merge, read_manifest
from twobp.runtime.state.checkpoint.integrity import crc32

pytestmark = [needs_no_process_group, pytest.mark.usefixtures("torch_one_thread")]

DATA = "__0_0.distcp"


@pytest.fixture
def saved(tmp_path) -> tuple[Path, Path]:
    """A folder of checkpoints of steps 1 and 2; returns (step 1, step 2)."""
    pipe = conv(5.0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    train_steps(pipe, optimizer, range(1))
    first = pipe.save(tmp_path, optimizer, step=1, keep=2)
    train_steps(pipe, optimizer, range(1, 2))
    return first, pipe.save(tmp_path, optimizer, step=2, keep=2)


def _load_fails(root: Path, message: str) -> None:
    """Loading ``root`` (its latest) fails with ``message``, and changes nothing."""
    pipe = conv(5.0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        pipe.load(root, optimizer)
    assert message in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in pipe.state_dict().items())
    assert pipe.step_count == 0 and not optimizer.state


def _info(path: Path, capsys) -> tuple[int, str, str]:
    code = checkpoint_cli(["info", str(path)])
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def test_the_manifest_records_every_file_with_its_size_and_crc32(saved):
    _, path = saved
    files = read_manifest(path)["files"]
    assert sorted(files) == [".metadata", DATA]
    for name, entry in files.items():
        assert entry == {"bytes": (path / name).stat().st_size, "crc32": crc32(path / name)}


def test_an_intact_checkpoint_is_reported_intact(saved, capsys):
    _, path = saved
    code, out, err = _info(path, capsys)
    assert code == 0 and err == ""
    assert "  files: 2, " in out and "each checked for its size and CRC-32" in out
    assert out.rstrip().endswith("intact")


def test_a_broken_manifest(saved, capsys):
    first, path = saved
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text[: len(text) // 2])
    want = f"{path / 'manifest.json'} is damaged: it is not valid JSON ("
    previous = f"; the previous intact checkpoint is {first}"
    _load_fails(path.parent, want)
    _load_fails(path.parent, previous)
    with pytest.raises(CheckpointError, match="is damaged: it is not valid JSON") as info:
        merge(path.parent)
    assert str(info.value).endswith(previous)
    code, out, err = _info(path.parent, capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"twobp checkpoint: error: {want}") and err.count("\n") == 1
    assert err.rstrip().endswith(previous)
    # Valid JSON, but not all of a manifest.
    manifest = json.loads(text)
    del manifest["tensors"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    _load_fails(path, "manifest.json is damaged: it lacks 'tensors'")


def test_garbage_metadata_reads_as_damage_not_as_a_refusal(saved, capsys):
    _, path = saved
    metadata = path / ".metadata"
    size = metadata.stat().st_size
    metadata.write_bytes(b"\xf7" * size)  # its size as saved: only the CRC-32 tells
    _load_fails(path.parent, f"{metadata} is damaged: it does not read as DCP's metadata")
    code, out, err = _info(path, capsys)
    assert code == 2
    assert f"  damaged: {metadata} is damaged: it does not read as DCP's metadata" in out
    assert err.startswith(f"twobp checkpoint: error: {metadata} is damaged: it does not read")
    assert "twobp does not unpickle" not in out + err


def test_a_truncated_data_file(saved, capsys):
    first, path = saved
    data = path / DATA
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:-10])
    want = f"{data} is truncated: {size - 10:,} bytes of the {size:,} it had when saved"
    _load_fails(path.parent, want)
    with pytest.raises(CheckpointError, match="is truncated"):
        merge(path)
    code, out, err = _info(path.parent, capsys)
    assert code == 2 and f"  damaged: {want}\n" in out and "intact" not in out
    assert err == f"twobp checkpoint: error: {want}; the previous intact checkpoint is {first}\n"


def test_a_data_file_changed_in_place(saved, capsys):
    _, path = saved
    data = path / DATA
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit, in a tensor's data: torch would load it
    data.write_bytes(bytes(raw))
    want = f"{data} is damaged: its CRC-32 is "
    _load_fails(path.parent, want)
    with pytest.raises(CheckpointError, match="when saved \\(the file changed since\\)"):
        merge(path)
    code, out, _ = _info(path, capsys)
    assert code == 2 and f"  damaged: {want}" in out


def test_a_missing_data_file(saved, capsys):
    first, path = saved
    (path / DATA).unlink()
    _load_fails(path.parent, f"{path / DATA} is missing; the previous intact checkpoint is {first}")
    code, out, _ = _info(path, capsys)
    assert code == 2 and f"  damaged: {path / DATA} is missing\n" in out
    # A damaged one before it is not named.
    (first / DATA).write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        merge(path)
    assert "previous" not in str(info.value)


def test_the_first_checkpoint_has_no_previous_to_name(saved):
    first, _ = saved
    (first / DATA).write_bytes(b"")
    _load_fails(first, f"{first / DATA} is truncated: 0 bytes")
    with pytest.raises(CheckpointError) as info:
        merge(first)
    assert "previous" not in str(info.value)


def _as_saved_before_sizes(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_without_sizes_loads_and_is_checked_for_what_dcp_knows(saved, capsys):
    _, path = saved
    _as_saved_before_sizes(path)
    want = merge(path)
    pipe = conv(5.0)
    pipe.load(path, torch.optim.AdamW(pipe.parameters()))
    assert all(torch.equal(pipe.state_dict()[k], v) for k, v in want.items())
    code, out, _ = _info(path, capsys)
    assert code == 0 and "saved before twobp recorded their sizes" in out
    # DCP's metadata says where each tensor ends: a truncated file is found all the same.
    data = path / DATA
    data.write_bytes(data.read_bytes()[:-10])
    _load_fails(path, f"{data} is truncated: ")
    code, out, _ = _info(path, capsys)
    assert code == 2 and "but its tensors reach byte " in out
