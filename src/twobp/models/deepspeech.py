"""A DeepSpeech-2-like speech recogniser, cut into pipeline blocks.

Blocks, in order::

    ConvFrontEnd            spectrogram (B, T, F)  -> features (B, T/2, dim)
    RecurrentBlock x n      features               -> features
    CTCHead                 features               -> character logits (B, T/2, vocab)

As in DeepSpeech 2 (Amodei et al., 2016): two 2-D convolutions over time and
frequency (the first strides time by 2) with clipped ReLUs, bidirectional GRU
layers whose two directions are summed, and a linear layer to characters
trained with CTC (id 0 is the blank). Each recurrent block normalises its
input first and adds it back after the GRU. The engine defers every GRU
weight's gradient to W (:mod:`twobp.engine.ops.recurrent`).

The data are synthetic utterances that can be learnt: each character has a
fixed spectral pattern, an utterance is its characters' patterns one after the
other (a few frames each) in noise, and the labels are the characters, padded
with ``-100`` to the longest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from twobp.models.common import Device, build_blocks, home_device, upcast
from twobp.models.spec import ModelSpec, stacked_kinds

PAD_LABEL = -100
"""A padded position of the labels (after the utterance's last character)."""


@dataclass(frozen=True)
class DeepSpeechConfig:
    """Size of a DeepSpeech-2-like model and of its utterances."""

    vocab_size: int = 29
    """Output classes: the CTC blank (0) and the characters (a-z, space, apostrophe)."""
    n_features: int = 161
    """Frequency bins of the spectrogram."""
    channels: int = 32
    """Channels of the two convolutions."""
    dim: int = 1760
    """Width of the recurrent layers (each direction)."""
    n_layers: int = 7
    """Bidirectional GRU layers, one block each."""
    frames: int = 256
    """Spectrogram frames of an example utterance."""
    label_len: int = 32
    """The most characters of an example utterance."""


def _clipped_relu(x: Tensor) -> Tensor:
    return F.hardtanh(x, 0.0, 20.0)


class ConvFrontEnd(nn.Module):
    """First block: two 2-D convolutions over (time, frequency) and a projection to ``dim``."""

    def __init__(self, config: DeepSpeechConfig) -> None:
        super().__init__()
        c = config.channels
        self.conv1 = nn.Conv2d(1, c, (5, 5), stride=(2, 2), padding=(2, 2))
        self.conv2 = nn.Conv2d(c, c, (5, 5), stride=(1, 2), padding=(2, 2))
        bins = (config.n_features + 1) // 2
        bins = (bins + 1) // 2
        self.proj = nn.Linear(c * bins, config.dim)

    def forward(self, spectrogram: Tensor) -> Tensor:
        x = _clipped_relu(self.conv1(spectrogram.unsqueeze(1)))  # (B, C, T/2, F/2)
        x = _clipped_relu(self.conv2(x))  # (B, C, T/2, F/4)
        x = x.permute(0, 2, 1, 3).flatten(2)  # (B, T/2, C * F/4)
        return _clipped_relu(self.proj(x))


class RecurrentBlock(nn.Module):
    """``x + sum of directions(biGRU(layer_norm(x)))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gru = nn.GRU(dim, dim, batch_first=True, bidirectional=True)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.gru(self.norm(x))[0]
        forward, backward = out.chunk(2, -1)
        return x + forward + backward


class CTCHead(nn.Module):
    """Last block: a norm and the linear layer to character logits."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.norm(x))  # type: ignore[no-any-return]


def deepspeech_blocks(
    config: DeepSpeechConfig,
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> list[nn.Module]:
    """The blocks of a DeepSpeech-2-like model.

    Args:
        config: the model's size.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed (``None``: global random state).

    Returns:
        ``[ConvFrontEnd, RecurrentBlock * n_layers, CTCHead]``.
    """
    factories: list[Callable[[], nn.Module]] = [lambda: ConvFrontEnd(config)]
    factories += [lambda: RecurrentBlock(config.dim)] * config.n_layers
    factories.append(lambda: CTCHead(config.dim, config.vocab_size))
    return build_blocks(factories, device=device, dtype=dtype, seed=seed)


def ctc_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """CTC of character logits ``(B, T, vocab)`` against labels ``(B, L)`` padded with -100.

    Every frame of the logits is an input; each utterance's loss is divided by
    its number of characters, and the mean is taken over the batch (so equal
    micro-batches average to the whole batch's loss).
    """
    log_probs = F.log_softmax(upcast(logits), -1).transpose(0, 1)  # (T, B, vocab)
    lengths = (labels != PAD_LABEL).sum(1)
    frames = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.long, device=logits.device)
    return F.ctc_loss(log_probs, labels.clamp(min=0), frames, lengths, reduction="mean")


def synthetic_utterances(
    config: DeepSpeechConfig, batch_size: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Spectrograms ``(B, frames, n_features)`` of random character strings, and their labels.

    The characters' spectral patterns are fixed (the same for every seed); each
    utterance holds between half and all of ``label_len`` characters, a few
    frames each, then silence, all in noise.
    """
    patterns = torch.randn(
        config.vocab_size, config.n_features, generator=torch.Generator().manual_seed(7)
    )
    gen = torch.Generator().manual_seed(seed)
    per_char = config.frames // config.label_len
    lengths = torch.randint(
        config.label_len // 2, config.label_len + 1, (batch_size,), generator=gen
    )
    labels = torch.randint(1, config.vocab_size, (batch_size, config.label_len), generator=gen)
    positions = torch.arange(config.label_len)
    labels = labels.masked_fill(positions >= lengths[:, None], PAD_LABEL)
    frames = patterns[labels.clamp(min=0)] * (labels >= 0)[..., None]  # (B, L, F)
    frames = frames.repeat_interleave(per_char, 1)
    spectrogram = torch.zeros(batch_size, config.frames, config.n_features)
    spectrogram[:, : frames.shape[1]] = frames
    spectrogram += 0.5 * torch.randn(spectrogram.shape, generator=gen)
    return spectrogram.to(dtype), labels


def build_deepspeech(
    config: DeepSpeechConfig,
    size: str = "custom",
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> ModelSpec:
    """A DeepSpeech-2-like model as pipeline blocks, with synthetic utterances and CTC.

    Args:
        config: the model's size.
        size: the preset name, for reports.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32); the spectrograms use it too.
        seed: initialisation seed (``None``: global random state).

    Returns:
        The model spec; ``example_input`` gives spectrograms ``(B, frames,
        n_features)``, ``example_target`` labels ``(B, label_len)`` padded with -100.

    Raises:
        ValueError: if an utterance's characters do not fit its frames.
    """
    if config.frames < 4 * config.label_len:
        raise ValueError(
            f"deepspeech: {config.frames} frames cannot hold {config.label_len} characters "
            f"(CTC needs frames >= 4 * label_len after the stride of 2); raise frames"
        )
    blocks = deepspeech_blocks(config, device=device, dtype=dtype, seed=seed)
    place = home_device(device)

    def make_batch(batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
        x, y = synthetic_utterances(config, batch_size, seed, dtype or torch.float32)
        return x.to(place), y.to(place)

    return ModelSpec(
        family="deepspeech",
        size=size,
        config=config,
        blocks=blocks,
        block_kinds=stacked_kinds(config.n_layers),
        loss_fn=ctc_loss,
        make_batch=make_batch,
        meta={"vocab_size": config.vocab_size, "frames": config.frames},
    )
