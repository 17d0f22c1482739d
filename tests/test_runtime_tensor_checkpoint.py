"""Checkpoints of tensor-parallel pipelines: each rank writes its own shards (DTensors on the
tensor-parallel sub-mesh, through torch.distributed.checkpoint), none joins them; they load
at another T, P and D through DCP's resharding, and merge into the whole model's tensors
(4 ranks, gloo, float64, against one process on the whole model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensor_checkpoint_workers import Phase, run_phases
from twobp.runtime import launch
from twobp.runtime.state.checkpoint import latest_checkpoint, merge, read_manifest
from twobp.runtime.state.checkpoint.storage import SafeReader, read, tensor_shapes

TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Saved at P 2 x T 2 and at D 2 x P 1 x T 2 (in the background) after 2 AdamW steps;
    each loaded into other layouts for 2 more; the same at P 2 x T 2 with the head tied
    across pipeline ranks to a vocabulary-split embedding, and with the head split by
    columns."""
    root = tmp_path_factory.mktemp("tensor-checkpoints")
    a, b = str(root / "p2-t2"), str(root / "d2-t2")
    tied, split = str(root / "tied"), str(root / "split")
    first, then = range(0, 2), range(2, 4)
    phases = [
        Phase(1, 2, first, save=a),
        Phase(2, 2, first, save=b, async_save=True),
        Phase(1, 1, then, load=a),  # T 1, P 4
        Phase(2, 2, then, load=a),  # T 2, P 1, D 2
        Phase(2, 1, then, load=a),  # D 2 x P 2
        Phase(1, 2, then, load=b),  # P 2 x T 2
        Phase(1, 2, first, save=tied, head="tied"),
        Phase(1, 1, then, load=tied, head="tied"),
        Phase(1, 2, first, save=split, head="split"),
        Phase(2, 2, then, load=split, head="split"),
    ]
    return root, launch(run_phases, 4, phases, timeout=600)


def test_next_steps_after_a_load_at_another_t_p_and_d_equal_one_process(plain):
    for errors in plain[1]:
        assert errors["loss"] < TOLERANCE and errors["parameters"] < TOLERANCE, errors


def test_each_tensor_parallel_rank_writes_its_own_shards(plain):
    """No rank joins a split tensor: in DCP's metadata each split parameter (and its AdamW
    moments) is T chunks of the shard's shape, each in the file of the rank that holds it."""
    root, results = plain
    folder = latest_checkpoint(root / "p2-t2")
    metadata = SafeReader(folder).read_metadata()
    files = {index: info.relative_path for index, info in metadata.storage_data.items()}
    split = {}
    for errors in results:
        for name, (shape, dim, tp_rank) in (errors["split"] or {}).items():
            split.setdefault(name, []).append((errors["rank"], shape, dim, tp_rank))
    assert len(split) == 7 * 4  # every decoder linear, each written by both shards' ranks
    for name, holders in split.items():
        assert sorted(h[3] for h in holders) == [0, 1], (name, holders)
        for entry in (f"model.{name}", f"optimizer.state.{name}.exp_avg"):
            chunks = metadata.state_dict_metadata[entry].chunks
            assert len(chunks) == 2, (entry, chunks)
            for rank, shape, dim, tp_rank in holders:
                offsets = [0] * len(shape)
                offsets[dim] = tp_rank * shape[dim]
                chunk = next(c for c in chunks if list(c.offsets) == offsets)
                assert list(chunk.sizes) == shape, (entry, chunk)
                writer = next(f for i, f in files.items() if i.fqn == entry and
                              list(i.offset) == offsets)  # fmt: skip
                assert writer == f"__{rank}_0.distcp", (entry, writer, rank)
    whole = read_manifest(folder)["tensors"]
    for name, holders in split.items():
        shape, dim = list(holders[0][1]), holders[0][2]
        shape[dim] *= 2
        assert whole[name]["shape"] == shape


def test_merge_gives_the_whole_model_by_its_names(plain):
    root, results = plain
    references = next(r["reference"] for r in results if r["reference"] is not None)
    for saved, head in (("p2-t2", "whole"), ("d2-t2", "whole"), ("tied", "tied"),
                        ("split", "split")):  # fmt: skip
        reference = references[head][1]
        merged = merge(root / saved)
        assert set(merged) == set(reference)
        for name, tensor in reference.items():
            assert merged[name].shape == tensor.shape, name
            assert torch.allclose(merged[name], tensor, rtol=0, atol=TOLERANCE), name


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> list[dict]:
    """D 2 x T 2 with its AdamW state sharded over each shard's copies (saved in the
    background: its parameters are views of flat buffers), and with its parameters sharded
    too, saved after 2 steps; loaded sharded and not, at T 1 and 2."""
    root = tmp_path_factory.mktemp("tensor-sharded-checkpoints")
    c, d = str(root / "optimizer"), str(root / "parameters")
    first, then = range(0, 2), range(2, 4)
    phases = [
        Phase(2, 2, first, save=c, optimizer="sharded", async_save=True),
        Phase(2, 2, first, save=d, optimizer="parameters"),
        Phase(1, 1, then, load=c),  # T 1, P 4, AdamW whole
        Phase(2, 2, then, load=c, optimizer="parameters"),
        Phase(2, 1, then, load=d, optimizer="sharded"),  # D 2 x P 2
        Phase(1, 2, then, load=d),  # P 2 x T 2, AdamW whole
    ]
    return launch(run_phases, 4, phases, timeout=600)


def test_a_sharded_optimizer_of_a_tensor_parallel_pipeline_saves_and_loads_anywhere(sharded):
    for errors in sharded:
        assert errors["loss"] < TOLERANCE and errors["parameters"] < TOLERANCE, errors


def test_checkpoint_info_says_it_holds_tensor_parallel_shards(plain, capsys):
    from twobp.cli.checkpoint import main as checkpoint_cli

    assert checkpoint_cli(["info", str(plain[0] / "p2-t2")]) == 0
    printed = capsys.readouterr().out
    assert "tensor parallel 2: each rank's shards of the split tensors" in printed
    assert "2 pipeline ranks x 2 tensor-parallel, schedule" in printed


def test_half_precision_shards_resume_from_their_float32_masters(tmp_path):
    """bfloat16 at D 2 x T 2 with a sharded optimizer: a load resumes bitwise, and each
    float32 master in the checkpoint, put together from every rank's ranges of its shard,
    rounds to the saved weight."""
    from tensor_checkpoint_workers import half_precision_resumes

    for went_on, resumed in launch(half_precision_resumes, 4, str(tmp_path), timeout=600):
        assert went_on == resumed
    folder = latest_checkpoint(tmp_path)
    shapes = tensor_shapes(folder)
    masters = [n.removeprefix("optimizer.master.") for n in shapes if "optimizer.master." in n]
    assert len(masters) >= 7 * 4  # every split linear, among others
    tensors = {n: torch.empty(s, dtype=d) for n, (s, d) in shapes.items() if "master" in n}
    tensors |= {f"model.{n}": torch.empty(*shapes[f"model.{n}"][:1], dtype=torch.bfloat16)
                for n in masters}  # fmt: skip
    read(tensors, folder, None)
    for name in masters:
        rounded = tensors[f"optimizer.master.{name}"].to(torch.bfloat16)
        assert torch.equal(rounded, tensors[f"model.{name}"]), name
