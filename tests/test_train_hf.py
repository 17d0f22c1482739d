"""`twobp train --hf-config`: a Hugging Face model through the same job and report."""

import json

import pytest
import torch

import twobp.train.preflight
from twobp.cli.main import main

pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_a_hugging_face_llama_trains_on_two_ranks(tmp_path):
    out = tmp_path / "run"
    code = main(
        [
            "train", "--hf-config", "llama", "--size", "tiny", "--steps", "3",
            "--batch-size", "4", "--microbatches", "2", "--seq-len", "16", "--warmup", "1",
            "--threads", "1", "--timeout", "60", "--no-save", "--two-bp", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 3
    # A fresh byte-level model starts near ln(256) = 5.5.
    assert 4.5 < metrics["loss_first"] < 6.5
    report = (out / "report.md").read_text()
    assert report.startswith("# twobp train: hf-llama-tiny 1f1b 2BP:paper")
    assert "(byte-level, next byte)" in report


def test_hf_config_without_transformers_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(twobp.train.preflight, "transformers_importable", lambda: False)
    code = main(["train", "--hf-config", "gpt2", "--out", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err == (
        "twobp train: error: --hf-config needs the transformers extra "
        "(pip install twobp[transformers])\n"
    )


def test_hf_tasks_take_the_bytes_as_labels_and_bert_masks_some():
    from twobp.train.config import TrainConfig
    from twobp.train.task import HF_MASK_TOKEN, build_task

    def task(kind):
        return build_task(TrainConfig(hf_config=kind, batch_size=4, seq_len=20))

    llama = task("llama")
    ids, labels = llama.batch_at(0, "train")
    assert ids.shape == (4, 20) and torch.equal(ids, labels)  # the model's loss shifts them
    assert llama.spec.n_blocks == 4 and llama.spec.blocks[0].embedding.num_embeddings == 256
    masked, targets = task("bert").batch_at(0, "train")
    chosen = targets != -100
    assert chosen.sum(dim=1).tolist() == [3] * 4  # 15% of 20 positions per sequence
    assert bool((masked[chosen] == HF_MASK_TOKEN).all()) and bool((masked[~chosen] < 256).all())
    torch.testing.assert_close(targets[chosen], ids[chosen])  # the same text, step and seed


def test_a_partition_error_names_the_hugging_face_model_and_its_blocks():
    from twobp.integrations.transformers import n_blocks
    from twobp.train.config import TrainConfig
    from twobp.train.preflight import OptionError, check_config

    with pytest.raises(OptionError, match=r"\(2 stages, hf-gpt2-small has 6 blocks\)"):
        check_config(TrainConfig(hf_config="gpt2", size="small", partition="1,1"))
    assert n_blocks("small") == 6


def test_a_hugging_face_mixtral_trains_with_its_routers_loss(tmp_path):
    out = tmp_path / "run"
    code = main(
        [
            "train", "--hf-config", "mixtral", "--size", "tiny", "--steps", "12",
            "--batch-size", "4", "--microbatches", "2", "--seq-len", "16", "--warmup", "1",
            "--threads", "1", "--timeout", "60", "--no-save", "--two-bp", "--log-every", "4",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 12
    assert metrics["loss_last"] < metrics["loss_first"] - 0.5
    assert (out / "report.md").read_text().startswith("# twobp train: hf-mixtral-tiny")
    from twobp.integrations.transformers import build_model

    config = build_model("mixtral", "tiny").config
    # The loss is the model's with its routers' auxiliary term.
    assert config.output_router_logits and config.num_local_experts == 4
