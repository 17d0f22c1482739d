"""A pipeline of a Hugging Face model's blocks, saved, back to a ``save_pretrained`` folder.

Two gloo ranks train ``blocks(model)`` of a tiny GPT-2 and Qwen2 (head tied to the
embedding) for two AdamW steps and save a checkpoint; the export of that checkpoint,
through ``from_pretrained`` with strict loading, must hold what the same steps give in
one process with plain PyTorch (float64).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_export_workers import build, every_kind, trained_in_one_process  # noqa: E402
from twobp.integrations.hf_export import ExportError  # noqa: E402
from twobp.integrations.transformers import state_dict  # noqa: E402
from twobp.runtime import launch  # noqa: E402

KINDS = ["gpt2", "qwen2"]
pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf-export")
    launch(every_kind, 2, KINDS, str(folder), threads_per_rank=1, timeout=300)
    return folder


@pytest.mark.parametrize("kind", KINDS)
def test_the_export_loads_strictly_and_from_pretrained_reads_it(saved, kind, tmp_path):
    fresh = build(kind, seed=1)  # other values: the export must replace every one
    exported = state_dict(fresh, saved / kind)
    assert set(exported) == set(fresh.state_dict())
    fresh.load_state_dict(exported, strict=True)
    fresh.save_pretrained(tmp_path / "hf")
    loaded = type(fresh).from_pretrained(tmp_path / "hf", torch_dtype=torch.float64)
    want = trained_in_one_process(kind)
    got = loaded.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-10, msg=name)
    # The tie is kept: the head is the embedding.
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def test_a_checkpoint_of_another_model_is_refused(saved):
    other = build("qwen2", seed=0)
    with pytest.raises(ExportError, match="the same configuration"):
        state_dict(other, saved / "gpt2")


def test_the_command_writes_a_folder_from_pretrained_reads(saved, tmp_path):
    out = tmp_path / "hf"
    config = tmp_path / "config.json"
    model_config = build("gpt2", seed=0).config
    model_config.architectures = ["GPT2LMHeadModel"]  # as save_pretrained writes it
    model_config.to_json_file(config)
    done = subprocess.run(
        [sys.executable, "-m", "twobp.cli.main", "checkpoint", "export-hf", str(saved / "gpt2"),
         str(out), "--hf-config-file", str(config)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.float64)
    want = trained_in_one_process("gpt2")
    for name, value in want.items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=1e-10)


def test_a_train_run_exports_without_a_config_file(tmp_path):
    from twobp.cli.main import main

    run = tmp_path / "run"
    argv = ["train", "--hf-config", "gpt2", "--steps", "2", "--batch-size", "4",
            "--microbatches", "2", "--seq-len", "16", "--threads", "1",
            "--out", str(run)]  # fmt: skip
    assert main(argv) == 0
    assert main(["checkpoint", "export-hf", str(run), str(tmp_path / "hf")]) == 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    from twobp.runtime.state.checkpoint import merge

    saved = merge(run)
    # The head is the embedding, which the first block holds.
    (embedding,) = [v for k, v in saved.items() if k.endswith("wte.weight")]
    torch.testing.assert_close(loaded.transformer.wte.weight, embedding.to(torch.float32))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_a_config_without_its_model_class_is_refused(saved, tmp_path, capsys):
    from twobp.cli.main import main

    build("gpt2", seed=0).config.to_json_file(tmp_path / "config.json")
    argv = ["checkpoint", "export-hf", str(saved / "gpt2"), str(tmp_path / "hf"),
            "--hf-config-file", str(tmp_path / "config.json")]  # fmt: skip
    assert main(argv) == 2
    assert "names no model class" in capsys.readouterr().err


def test_a_checkpoint_without_a_run_config_asks_for_the_config_file(saved, tmp_path, capsys):
    from twobp.cli.main import main

    assert main(["checkpoint", "export-hf", str(saved / "gpt2"), str(tmp_path / "hf")]) == 2
    assert "pass --hf-config-file" in capsys.readouterr().err
