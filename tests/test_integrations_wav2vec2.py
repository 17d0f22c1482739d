"""Hugging Face speech models with a CTC head (Wav2Vec2ForCTC, HubertForCTC) as pipeline blocks.

The blocks equal the model's own forward, the loss its own CTC (labels padded with -100,
input lengths from the feature encoder), and a 2-rank pipeline (1f1b with 2BP, zb-v) equals
the model in one process over 3 AdamW steps in float64.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from rank_parity import assert_equal_to_one_process
from twobp.runtime import Pipeline, launch

transformers = pytest.importorskip("transformers")
from twobp.integrations import wav2vec2  # noqa: E402
from twobp.integrations.transformers import blocks, loss_function  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

TOL = 1e-9
STEPS = 3
N_MB = 2
SAMPLES = 20 * 30
SCHEDULES = ("1f1b", "zb-v")


def make_model(kind: str = "wav2vec2", **config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = wav2vec2.build_model(kind)
    for name, value in config.items():
        setattr(model.config, name, value)
    return model.double()


def make_batch(step: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_values, attention_mask, labels)`` of 2 micro-batches of 2 utterances; the second
    of each is padded (audio and labels), so the micro-batches hold different lengths."""
    g = torch.Generator().manual_seed(step)
    values = torch.randn(2 * N_MB, SAMPLES, generator=g, dtype=torch.float64)
    mask = torch.ones(2 * N_MB, SAMPLES, dtype=torch.long)
    labels = torch.randint(1, 32, (2 * N_MB, 6), generator=g)
    for row, (samples, length) in {1: (400, 4), 3: (500, 5)}.items():
        mask[row, samples:] = 0
        values[row, samples:] = 0
        labels[row, length:] = -100
    return values, mask, labels


@pytest.mark.parametrize("kind", ["wav2vec2", "hubert"])
@pytest.mark.parametrize("stable", [False, True])
def test_blocks_and_loss_equal_the_models_own(kind, stable):
    model = make_model(kind, do_stable_layer_norm=stable)
    if stable:  # the layout of the large checkpoints: the encoder's norm after its layers
        config = model.config
        config.feat_extract_norm = "layer"
        model = type(model)(config).double()
    values, mask, labels = make_batch(0)
    own = model(input_values=values, attention_mask=mask, labels=labels)
    output = blocks(model)((values, mask))
    logits, frames = output
    torch.testing.assert_close(logits, own.logits, rtol=0, atol=1e-12)
    lengths = model._get_feat_extract_output_lengths(mask.sum(-1))
    assert torch.equal(frames.sum(-1), lengths)
    total, count = loss_function(model)(output, labels)
    # The model's own CTC runs in float32 whatever the logits.
    assert math.isclose(float(total / count), float(own.loss), rel_tol=1e-6)
    unpadded = model(input_values=values[:1]).logits
    torch.testing.assert_close(blocks(model)(values[:1]), unpadded, rtol=0, atol=1e-12)


def test_each_parameter_is_in_one_block_and_every_trained_one_in_some_block():
    model = make_model()
    seen: dict[int, int] = {}
    for index, block in enumerate(blocks(model)):
        for p in block.parameters():
            assert id(p) not in seen, f"a parameter of block {seen.get(id(p))} is in {index} too"
            seen[id(p)] = index
    missing = [n for n, p in model.named_parameters() if id(p) not in seen]
    assert missing == [], missing  # SpecAugment is off: no masked_spec_embed to leave out


def test_sum_reduction_is_the_models_loss_per_utterance():
    model = make_model(ctc_loss_reduction="sum")
    values, mask, labels = make_batch(1)
    own = model(input_values=values, attention_mask=mask, labels=labels)
    total, count = loss_function(model)(blocks(model)((values, mask)), labels)
    assert count == 4
    assert math.isclose(float(total), float(own.loss), rel_tol=1e-6)


def test_speech_models_twobp_does_not_cover_are_refused_by_name():
    config = transformers.WavLMConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        vocab_size=8,
    )
    model = transformers.WavLMForCTC(config)
    with pytest.raises(ValueError, match="WavLMForCTC: WavLM passes a relative position bias"):
        blocks(model)
    with pytest.raises(ValueError, match="WavLM"):
        loss_function(model)


def test_a_model_that_masks_or_drops_layers_in_training_is_warned_about():
    model = wav2vec2.build_model("wav2vec2")
    model.config.apply_spec_augment, model.config.mask_time_prob = True, 0.05
    model.config.layerdrop = 0.1
    with pytest.warns(UserWarning, match="apply no SpecAugment and LayerDrop"):
        blocks(model)


def test_split_points_to_blocks():
    import twobp

    with pytest.raises(twobp.SplitError, match=r"integrations.transformers.blocks\(model\)"):
        twobp.split(make_model(), at=["wav2vec2.encoder.layers.1"])


def _train(schedule: str) -> dict[str, Any]:
    model = make_model()
    values, mask, _ = make_batch(0)
    pipe = Pipeline(
        blocks(model),
        loss_function(model),
        schedule=schedule,
        n_microbatches=N_MB,
        two_bp=True,
        device="cpu",
        timeout=60.0,
        example_input=(values[:2], mask[:2]),
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        values, mask, labels = make_batch(step)
        losses.append(pipe.step((values, mask), labels))
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
        optimizer.step()
        pipe.zero_grad()
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    return {"losses": losses, "grads": grads, "state": state, "schedule": pipe.schedule.name}


def _session() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: _train(name) for name in SCHEDULES}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return launch(_session, 2, threads_per_rank=1, timeout=300)


def _reference() -> tuple[list[float], list[dict[str, Tensor]], dict[str, Tensor]]:
    """The model in one process: its own forward, the CTC in float64 on its logits."""
    model = make_model()
    loss_fn = loss_function(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    named = dict(blocks(model).named_parameters())
    losses, grads = [], []
    for step in range(STEPS):
        values, mask, labels = make_batch(step)
        logits = model(input_values=values, attention_mask=mask).logits
        frames = model._get_feature_vector_attention_mask(logits.shape[1], mask)
        total, count = loss_fn((logits, frames), labels)
        loss = total / count
        loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad.clone() for n, p in named.items() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in named.items()}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_ranks_equal_one_process_over_three_adamw_steps(schedule, per_rank):
    results = [r[schedule] for r in per_rank]
    assert_equal_to_one_process(results, _reference(), TOL)


def test_twobp_train_hf_config_wav2vec2_runs_end_to_end_with_a_falling_loss(tmp_path):
    import json

    from twobp.cli.main import main

    out = tmp_path / "run"
    code = main(
        [
            "train", "--hf-config", "wav2vec2", "--steps", "30", "--batch-size", "8",
            "--microbatches", "2", "--threads", "1", "--timeout", "60", "--no-save",
            "--two-bp", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_run"] == 30
    assert metrics["loss_last"] < 0.5 * metrics["loss_first"], metrics["losses"]
    report = (out / "report.md").read_text()
    assert report.startswith("# twobp train: hf-wav2vec2-tiny 1f1b 2BP")
    assert "synthetic audio" in report
