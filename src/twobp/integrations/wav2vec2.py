"""Hugging Face speech models with a CTC head (wav2vec 2.0, HuBERT) as pipeline blocks.

:func:`blocks` cuts ``Wav2Vec2ForCTC`` (and ``HubertForCTC``, laid out alike)
into::

    FeatureFrontEnd     raw audio (B, samples)  -> hidden states (B, frames, hidden)
    EncoderLayer x n    hidden states           -> hidden states
    CTCHead             hidden states           -> character logits (B, frames, vocab)

The front end is the convolutional feature encoder, the feature projection
and the start of the transformer encoder (the positional convolution, and the
encoder's norm where it comes before the layers); the head holds the norm
where it comes after them (``do_stable_layer_norm``) and ``lm_head``. Give the
first block ``input_values`` or ``(input_values, attention_mask)``: the mask
(1 for samples, 0 for padding) becomes the frames' mask, which travels with
the hidden states to every layer and, from the head, to the loss as the input
lengths of the CTC. :func:`loss_function` is the model's CTC (blank
``config.pad_token_id``, labels padded with ``-100``), as a sum over the
utterances and their count, so that any cut into micro-batches gives the
whole batch's loss: exactly the model's own for ``ctc_loss_reduction="mean"``;
for ``"sum"`` it is the model's loss divided by the batch size.

The blocks apply neither SpecAugment (``config.mask_time_prob``) nor LayerDrop,
which are random in training: build the model with ``apply_spec_augment=False``
and ``layerdrop=0`` for a pipeline that computes what the model computes.
WavLM (its relative position bias goes from layer to layer), the conformer
variant and models with an adapter are refused by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from twobp.integrations import SPEECH_FAMILIES

BASES = {"wav2vec2": "wav2vec2", "hubert": "hubert"}
"""The covered families and the attribute that holds each one's base model."""

REFUSED = {
    "wavlm": "WavLM passes a relative position bias from layer to layer",
    "wav2vec2_conformer": "the conformer's layers take rotary or relative positions",
    "unispeech": "UniSpeech is not covered yet",
    "unispeech_sat": "UniSpeech-SAT is not covered yet",
    "data2vec_audio": "Data2VecAudio is not covered yet",
}

Hidden = Tensor | tuple[Tensor, Tensor]
"""The hidden states, or ``(hidden_states, frame_mask)``."""


def speech_family(model: nn.Module) -> str | None:
    """``"wav2vec2"`` or ``"hubert"`` for a CTC model of that family, None for other models.

    Raises:
        ValueError: for a speech model with a CTC head that twobp does not cover (WavLM, ...).
    """
    if getattr(model, "lm_head", None) is None:
        return None
    for attribute, why in REFUSED.items():
        if isinstance(getattr(model, attribute, None), nn.Module):
            raise ValueError(
                f"twobp.integrations.wav2vec2 cannot cut a {type(model).__name__}: {why}; it "
                f"covers Wav2Vec2ForCTC and HubertForCTC"
            )
    for kind, attribute in BASES.items():
        if isinstance(getattr(model, attribute, None), nn.Module):
            return kind
    return None


def _split(x: Hidden) -> tuple[Tensor, Tensor | None]:
    if isinstance(x, (tuple, list)):
        return x[0], x[1]
    return x, None


def _join(hidden: Tensor, mask: Tensor | None) -> Hidden:
    return hidden if mask is None else (hidden, mask)


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out  # type: ignore[no-any-return]


class FeatureFrontEnd(nn.Module):
    """The feature encoder, the feature projection and the encoder's positional convolution
    (and its norm, where it comes before the layers)."""

    def __init__(self, base: nn.Module, config: Any) -> None:
        super().__init__()
        hf: Any = base
        self.conv_layers = hf.feature_extractor.conv_layers
        self.feature_projection = hf.feature_projection
        self.pos_conv_embed = hf.encoder.pos_conv_embed
        stable = bool(getattr(config, "do_stable_layer_norm", False))
        self.layer_norm = None if stable else hf.encoder.layer_norm
        self.dropout = hf.encoder.dropout
        self.convolutions = tuple(zip(config.conv_kernel, config.conv_stride, strict=True))

    def frames(self, mask: Tensor, count: int) -> Tensor:
        """The frames' mask of a mask over the samples, as the model computes it."""
        lengths = mask.sum(-1)
        for kernel, stride in self.convolutions:
            lengths = torch.div(lengths - kernel, stride, rounding_mode="floor") + 1
        positions = torch.arange(count, device=mask.device)
        return (positions < lengths[:, None]).to(mask.dtype)

    def forward(self, x: Hidden) -> Hidden:
        values, mask = _split(x)
        # The feature encoder's conv layers as its forward runs them, without its
        # ``requires_grad = True`` on the input, which fails on an input that needs a gradient.
        features = values[:, None]
        for conv in self.conv_layers:
            features = conv(features)
        features = features.transpose(1, 2)
        if mask is not None:
            mask = self.frames(mask, features.shape[1])
        hidden = _first(self.feature_projection(features))
        if mask is not None:  # padded frames start from zero, as in the model
            hidden = hidden * mask.unsqueeze(-1).to(hidden.dtype)
        hidden = hidden + self.pos_conv_embed(hidden)
        if self.layer_norm is not None:
            hidden = self.layer_norm(hidden)
        return _join(self.dropout(hidden), mask)


class EncoderLayer(nn.Module):
    """One transformer layer of the encoder, with its (bidirectional) padding mask."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, x: Hidden) -> Hidden:
        from twobp.integrations.transformers import _mask_function, _without_cache

        hidden, mask = _split(x)
        extended = _without_cache(
            _mask_function("create_bidirectional_mask"),
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None if mask is None else mask.bool(),
        )
        return _join(_first(self.layer(hidden, attention_mask=extended)), mask)


class CTCHead(nn.Module):
    """The encoder's closing norm (stable layer norm models), the dropout and ``lm_head``;
    returns the logits, and the frames' mask where the input had one."""

    def __init__(self, model: nn.Module, norm: nn.Module | None) -> None:
        super().__init__()
        hf: Any = model
        self.norm = norm
        self.dropout = hf.dropout
        self.lm_head = hf.lm_head

    def forward(self, x: Hidden) -> Hidden:
        hidden, mask = _split(x)
        if self.norm is not None:
            hidden = self.norm(hidden)
        return _join(self.lm_head(self.dropout(hidden)), mask)


def _base(model: nn.Module) -> tuple[str, Any]:
    kind = speech_family(model)
    if kind is None:
        raise ValueError(
            f"{type(model).__name__} is not a speech model with a CTC head "
            f"(Wav2Vec2ForCTC, HubertForCTC)"
        )
    base: Any = getattr(model, BASES[kind])
    if getattr(base, "adapter", None) is not None:
        raise ValueError(
            f"{type(model).__name__} with config.add_adapter: its adapter changes the frames "
            f"after the encoder, which twobp does not cover; build it without the adapter"
        )
    return kind, base


def _warn_if_random(config: Any, name: str) -> None:
    """Warn where the model would mask features (SpecAugment) or drop layers in training."""
    masks = getattr(config, "apply_spec_augment", False) and (
        getattr(config, "mask_time_prob", 0.0) > 0 or getattr(config, "mask_feature_prob", 0.0) > 0
    )
    dropped = getattr(config, "layerdrop", 0.0) > 0
    if masks or dropped:
        what = " and ".join(w for w, on in (("SpecAugment", masks), ("LayerDrop", dropped)) if on)
        warnings.warn(
            f"the blocks of this {name} apply no {what}, which the model applies in training; "
            f"set config.apply_spec_augment=False and config.layerdrop=0.0 to train what it "
            f"computes",
            stacklevel=3,
        )


def blocks(model: nn.Module) -> nn.Sequential:
    """Cut a ``Wav2Vec2ForCTC`` or ``HubertForCTC`` into pipeline blocks.

    Args:
        model: the model.

    Returns:
        The front end, one block per encoder layer, and the CTC head, sharing
        the model's modules.

    Raises:
        ValueError: for a model laid out otherwise (WavLM, an adapter, ...).
    """
    _, base = _base(model)
    hf: Any = model
    _warn_if_random(hf.config, type(model).__name__)
    stable = bool(getattr(hf.config, "do_stable_layer_norm", False))
    encoder = base.encoder
    parts: list[nn.Module] = [FeatureFrontEnd(base, hf.config)]
    parts += [EncoderLayer(layer, hf.config) for layer in encoder.layers]
    parts.append(CTCHead(model, encoder.layer_norm if stable else None))
    return nn.Sequential(*parts)


def loss_function(model: nn.Module) -> Callable[[Any, Tensor], tuple[Tensor, Tensor]]:
    """``loss(output, labels) -> (sum, count)``: the model's CTC over one micro-batch.

    ``output`` is what the last of :func:`blocks` returns: the logits, or
    ``(logits, frame_mask)``; the input lengths are the mask's frames (all the
    frames without a mask), as the model computes them from its attention mask.
    Labels are padded with ``-100``. The sum is over the utterances of the
    model's per-utterance loss (divided by its label length where the model's
    ``ctc_loss_reduction`` is ``"mean"``), the count is the utterances: the
    pipeline divides the sum over all micro-batches by the count over them.
    Float64 logits stay float64 (the model's own loss takes them to float32).

    Args:
        model: a model :func:`blocks` covers.

    Raises:
        ValueError: for a model :func:`blocks` refuses, or a reduction other than
            ``"mean"`` and ``"sum"``.
    """
    _base(model)
    hf: Any = model
    config = hf.config
    reduction = config.ctc_loss_reduction
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"config.ctc_loss_reduction={reduction!r}: twobp takes 'mean' or 'sum' "
            f"(the model's own loss needs one of them too)"
        )
    blank, zero_infinity = config.pad_token_id, config.ctc_zero_infinity

    def loss(output: Any, labels: Tensor) -> tuple[Tensor, Tensor]:
        logits, mask = _split(output)
        frames = logits.shape[1]
        if mask is None:
            lengths = torch.full((logits.shape[0],), frames, dtype=torch.long)
        else:
            lengths = mask.sum(-1).long()
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        log_probs = nn.functional.log_softmax(logits, -1, dtype=dtype).transpose(0, 1)
        labels = labels.to(logits.device)
        label_mask = labels >= 0
        per_utterance = nn.functional.ctc_loss(
            log_probs,
            labels.masked_select(label_mask),
            lengths,
            label_mask.sum(-1),
            blank=blank,
            reduction="none",
            zero_infinity=zero_infinity,
        )
        if reduction == "mean":
            per_utterance = per_utterance / label_mask.sum(-1).clamp(min=1).to(dtype)
        return per_utterance.sum(), torch.tensor(float(logits.shape[0]))

    return loss


SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "conv_dim": (16, 16, 16),
        "conv_stride": (5, 2, 2),
        "conv_kernel": (10, 3, 3),
        "num_conv_pos_embeddings": 16,
    },
    "small": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 512,
        "conv_dim": (64, 64, 64, 64),
        "conv_stride": (5, 2, 2, 2),
        "conv_kernel": (10, 3, 3, 3),
        "num_conv_pos_embeddings": 32,
    },
}
"""Model sizes that :func:`build_model` knows (4 attention heads, 4 positional groups)."""


def samples_per_frame(size: str) -> int:
    """How many audio samples one frame of a :func:`build_model` model of ``size`` covers."""
    stride = 1
    for s in SIZES[size]["conv_stride"]:
        stride *= s
    return stride


def build_model(kind: str, size: str = "tiny", *, vocab_size: int = 32) -> nn.Module:
    """A freshly initialised CTC model of a covered family (no download).

    Dropout, LayerDrop and SpecAugment are off, so that a pipeline and the model
    compute the same; the CTC loss is the mean over utterances of the loss per
    label (``ctc_loss_reduction="mean"``); id 0 is the blank.

    Args:
        kind: ``"wav2vec2"`` or ``"hubert"``.
        size: a key of :data:`SIZES`.
        vocab_size: the characters, the blank included.

    Raises:
        ValueError: for an unknown family or size.
    """
    import transformers

    if kind not in SPEECH_FAMILIES or size not in SIZES:
        raise ValueError(
            f"build_model takes a family of {SPEECH_FAMILIES} and a size of {list(SIZES)}"
        )
    fields: dict[str, Any] = {
        **SIZES[size],
        "vocab_size": vocab_size,
        "num_attention_heads": 4,
        "num_conv_pos_embedding_groups": 4,
        "hidden_dropout": 0.0,
        "activation_dropout": 0.0,
        "attention_dropout": 0.0,
        "feat_proj_dropout": 0.0,
        "final_dropout": 0.0,
        "layerdrop": 0.0,
        "apply_spec_augment": False,
        "mask_time_prob": 0.0,
        "ctc_loss_reduction": "mean",
        "pad_token_id": 0,
    }
    if kind == "wav2vec2":
        return transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**fields))
    return transformers.HubertForCTC(transformers.HubertConfig(**fields))
