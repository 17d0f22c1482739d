"""What a family trains on: the model spec plus a batch source indexed by step.

Language models (llama, mamba: next byte; bert: masked bytes), and the
Hugging Face models of ``--hf-config`` (the same tasks), read real text:
Python's own sources or ``--data FILE``. ResNet has no offline image set, so it
learns labelled synthetic images (see :class:`twobp.train.data.SyntheticData`),
and the DeepSpeech-like model synthetic utterances
(:func:`twobp.models.deepspeech.synthetic_utterances`); the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from twobp.integrations import SPEECH_FAMILIES
from twobp.models import ModelSpec, build_model, mask_tokens
from twobp.models.deepspeech import DeepSpeechConfig, synthetic_utterances
from twobp.models.spec import stacked_kinds
from twobp.runtime.state.grad_scaler import GradScaler
from twobp.train.config import TrainConfig, mean_seq_len, step_seq_len
from twobp.train.data import ByteLMData, SyntheticData, file_corpus, stdlib_corpus

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
AUTOCAST_DTYPES = ("bfloat16", "float16")
"""The ``--dtype`` values that ``--autocast`` takes."""

SYNTHETIC_FAMILIES = ("resnet", "deepspeech")
"""The families that learn synthetic data (no text, no --data, no --seq-len)."""

BatchAt = Callable[[int, str], tuple[torch.Tensor, torch.Tensor]]
"""``batch_at(step, split) -> (inputs, targets)`` for the whole batch of one step."""


@dataclass
class Task:
    """A model and the data that feeds it."""

    spec: ModelSpec
    """The model's blocks and loss."""
    batch_at: BatchAt
    """The batch of a step (``split`` is ``"train"`` or ``"eval"``)."""
    data_source: str
    """Where the data comes from, for the report."""
    tokens_per_sample: float | None
    """Tokens in one sample (on average, under ``--seq-len LO:HI``), for tokens/s (None
    for images: they have no tokens)."""


def model_overrides(cfg: TrainConfig) -> dict[str, Any]:
    """The fields of the model preset that ``cfg`` changes (the byte-level text's)."""
    if cfg.model in SYNTHETIC_FAMILIES:
        return {}
    overrides: dict[str, Any] = {"seq_len": cfg.seq_len}
    if cfg.model in ("llama", "mamba", "moe"):
        overrides["vocab_size"] = 256
    return overrides


def parameter_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype of the parameters: float32 under ``--autocast``, else ``--dtype``.

    Raises:
        ValueError: on an unknown dtype.
    """
    if cfg.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {cfg.dtype!r}; choose from {', '.join(DTYPES)}")
    return torch.float32 if cfg.autocast else DTYPES[cfg.dtype]


def loss_scale_mode(cfg: TrainConfig) -> str | float | None:
    """What ``--loss-scale`` asks for: ``"dynamic"``, a static scale, or None (no scaling).

    Raises:
        ValueError: on a value that is neither ``dynamic``, ``off`` nor a finite number above 0,
            or a scale asked for where there is nothing to scale (not float16 autocast).
    """
    text = cfg.loss_scale
    float16_autocast = cfg.autocast and cfg.dtype == "float16"
    if text is None:
        return "dynamic" if float16_autocast else None
    if text == "off":
        return None
    if text == "dynamic":
        mode: str | float = text
    else:
        try:
            mode = float(text)
        except ValueError:
            mode = math.nan
        if not (math.isfinite(mode) and mode > 0):
            raise ValueError(
                f"--loss-scale {text}: give dynamic, off, or a scale above 0 (e.g. 1024)"
            )
    if not float16_autocast:
        why = (
            "bfloat16 has float32's range and needs no loss scale"
            if cfg.dtype == "bfloat16"
            else "loss scaling is for float16 computation with float32 parameters"
        )
        raise ValueError(
            f"--loss-scale {text} with --dtype {cfg.dtype}{' --autocast' if cfg.autocast else ''}: "
            f"{why}; use --dtype float16 --autocast, or leave --loss-scale out"
        )
    return mode


def grad_scaler(cfg: TrainConfig) -> GradScaler | None:
    """The run's :class:`twobp.GradScaler` (see :func:`loss_scale_mode`), or None."""
    mode = loss_scale_mode(cfg)
    if mode is None:
        return None
    if mode == "dynamic":
        return GradScaler()
    # A static scale: it never moves; a step that overflows is still skipped.
    return GradScaler(init_scale=float(mode), growth_factor=1.0, backoff_factor=1.0)


def autocast_dtype(cfg: TrainConfig) -> torch.dtype | None:
    """The dtype of ``Pipeline(autocast=...)``: ``--dtype`` under ``--autocast``, else None."""
    return DTYPES[cfg.dtype] if cfg.autocast else None


def build_task(cfg: TrainConfig) -> Task:
    """Build the model (seeded, identical on every rank) and its data for ``cfg``.

    Raises:
        ValueError: on an unknown family, size or dtype.
        FileNotFoundError: if ``cfg.data`` does not exist.
    """
    dtype = parameter_dtype(cfg)
    if cfg.hf_config is not None:
        return _hf_task(cfg, dtype)
    if cfg.model == "resnet":
        spec = build_model("resnet", cfg.size, dtype=dtype, seed=cfg.seed, **model_overrides(cfg))
        size = spec.meta.get("image_size", 32)
        images = SyntheticData(
            "images",
            (3, size, size),
            spec.meta["num_classes"],
            source=f"synthetic {size}x{size} images: a smooth random pattern per class + noise",
        )

        def image_batch(step: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = images.batch(step, cfg.batch_size, cfg.seed, split=split)
            return x.to(dtype), y

        return Task(spec, image_batch, images.source, None)
    if cfg.model == "deepspeech":
        return _speech_task(cfg, dtype)

    raw, source = file_corpus(cfg.data, cfg.seq_len) if cfg.data else stdlib_corpus()
    spec = build_model(cfg.model, cfg.size, dtype=dtype, seed=cfg.seed, **model_overrides(cfg))
    text = ByteLMData.from_bytes(raw, cfg.seq_len, source)
    tokens = mean_seq_len(cfg)
    if cfg.model != "bert":

        def next_byte_batch(step: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
            length = _length(cfg, step, split)
            return text.batch(step, cfg.batch_size, cfg.seed, split=split, seq_len=length)

        return Task(spec, next_byte_batch, f"{source} (byte-level, next byte)", tokens)

    bert = spec.config

    def masked_batch(step: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        length = _length(cfg, step, split)
        ids, _ = text.batch(step, cfg.batch_size, cfg.seed, split=split, seq_len=length)
        gen = torch.Generator().manual_seed(cfg.seed * 31 + step * 2 + (split != "train"))
        n_masked = bert.n_masked if length == cfg.seq_len else _masked(length)
        return mask_tokens(ids, n_masked, bert.mask_token_id, gen)

    return Task(spec, masked_batch, f"{source} (byte-level, masked bytes)", tokens)


def _speech_task(cfg: TrainConfig, dtype: torch.dtype) -> Task:
    """The DeepSpeech-like model on synthetic utterances (a fresh batch per step and split)."""
    spec = build_model("deepspeech", cfg.size, dtype=dtype, seed=cfg.seed)

    def utterance_batch(step: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        return spec.make_batch(cfg.batch_size, cfg.seed * 1_000_003 + 2 * step + (split != "train"))

    source = (
        "synthetic utterances: a fixed spectral pattern per character, a few frames each, "
        "in noise (CTC over the characters)"
    )
    return Task(spec, utterance_batch, source, None)


def _length(cfg: TrainConfig, step: int, split: str) -> int:
    """The sequence length of a batch: drawn for training steps, the longest for evaluation."""
    return step_seq_len(cfg, step) if split == "train" else cfg.seq_len


def _masked(length: int) -> int:
    """Positions to mask in a sequence of ``length``: 15%, at least one."""
    return max(1, length * 15 // 100)


HF_MASK_TOKEN = 256
"""The ``[MASK]`` id of a Hugging Face BERT on bytes (its vocabulary: the 256 bytes and it)."""


def hf_model(cfg: TrainConfig) -> nn.Module:
    """The ``transformers`` model a ``--hf-config`` run trains (its configuration; values
    as the current random state gives them)."""
    from twobp.integrations import transformers as hf
    from twobp.integrations import wav2vec2

    kind = cfg.hf_config
    assert kind is not None, "not a --hf-config run"
    if kind in SPEECH_FAMILIES:
        return wav2vec2.build_model(kind, cfg.size, vocab_size=SPEECH_VOCAB)
    return hf.build_model(
        kind,
        cfg.size,
        tied=True,
        vocab_size=HF_MASK_TOKEN + 1 if kind == "bert" else 256,
        max_positions=cfg.seq_len,
    )


def _hf_task(cfg: TrainConfig, dtype: torch.dtype) -> Task:
    """A ``transformers`` model of ``cfg.hf_config`` (tied as published) on byte-level text.

    Causal LMs take the bytes as labels (the model's loss shifts them); BERT
    masks 15% of the positions of every sequence, deterministically per step.
    """
    from twobp.integrations import transformers as hf

    kind = cfg.hf_config
    assert kind is not None
    if kind in SPEECH_FAMILIES:
        return _hf_speech_task(cfg, dtype)
    masked = kind == "bert"
    torch.manual_seed(cfg.seed)
    model = hf_model(cfg).to(dtype)
    parts = list(hf.blocks(model))
    raw, source = file_corpus(cfg.data, cfg.seq_len) if cfg.data else stdlib_corpus()
    text = ByteLMData.from_bytes(raw, cfg.seq_len, source)

    def batch_at(step: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        length = _length(cfg, step, split)
        ids, _ = text.batch(step, cfg.batch_size, cfg.seed, split=split, seq_len=length)
        if not masked:
            return ids, ids
        gen = torch.Generator().manual_seed(cfg.seed * 31 + step * 2 + (split != "train"))
        return mask_tokens(ids, _masked(length), HF_MASK_TOKEN, gen)

    spec = _hf_spec(cfg, model, parts, hf.loss_function(model), batch_at)
    task = "masked bytes" if masked else "next byte"
    return Task(spec, batch_at, f"{source} (byte-level, {task})", mean_seq_len(cfg))


def _hf_spec(
    cfg: TrainConfig,
    model: nn.Module,
    parts: list[nn.Module],
    loss_fn: Any,
    batch_at: Callable[[int, str], tuple[torch.Tensor, torch.Tensor]],
) -> ModelSpec:
    """The spec of a ``--hf-config`` model cut into ``parts`` (first and last blocks the
    ends, the rest its layers), batches of step ``seed`` for the bench's ``make_batch``."""
    return ModelSpec(
        family=f"hf-{cfg.hf_config}",
        size=cfg.size,
        config=model.config,
        blocks=parts,
        block_kinds=stacked_kinds(len(parts) - 2),
        loss_fn=loss_fn,
        make_batch=lambda batch_size, seed: batch_at(seed, "train"),
    )


SPEECH_VOCAB = 16
"""Characters of the synthetic utterances a Hugging Face speech model learns (0: the blank)."""


def _hf_speech_task(cfg: TrainConfig, dtype: torch.dtype) -> Task:
    """A ``transformers`` CTC speech model of ``cfg.hf_config`` on synthetic raw audio.

    The audio is :func:`twobp.models.deepspeech.synthetic_utterances` read as a
    waveform: each character a fixed pattern of one frame's samples, repeated
    over eight frames, in noise.
    """
    from twobp.integrations import wav2vec2

    kind = cfg.hf_config
    assert kind is not None
    torch.manual_seed(cfg.seed)
    model = hf_model(cfg).to(dtype)
    parts = list(wav2vec2.blocks(model))
    utterances = DeepSpeechConfig(
        SPEECH_VOCAB, n_features=wav2vec2.samples_per_frame(cfg.size), frames=48, label_len=6
    )

    def batch_at(step: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        seed = cfg.seed * 1_000_003 + 2 * step + (split != "train")
        audio, labels = synthetic_utterances(utterances, cfg.batch_size, seed, dtype)
        return audio.flatten(1), labels

    spec = _hf_spec(cfg, model, parts, wav2vec2.loss_function(model), batch_at)
    source = "synthetic audio: a fixed waveform per character, eight frames each, in noise (CTC)"
    return Task(spec, batch_at, source, None)
