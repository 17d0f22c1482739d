"""A LLaMA-like decoder's sizes and costs per block, from its shapes alone.

FLOPs count a multiply-add as 2. Per token of one layer, the weight matrices
(``Q``, ``K``, ``V``, ``O``, gate, up, down) cost ``2 x weights`` in ``F``, as
much in ``I`` (input gradients) and as much in ``W`` (weight gradients):
``6 x params x tokens`` for a step, the usual figure. Attention's scores and
values (``QK^T``, ``AV``, full, not halved for causality, as Megatron counts
them) cost ``4 s h`` per token in ``F``; having no weights, their backward
(``8 s h``) is all in ``I``.

Bytes held per micro-batch (elements x dtype bytes, flash attention assumed,
so no ``s x s`` scores): from ``F`` to ``I`` the layer's saved inputs and
outputs, ``6h + 2kv + 4 ffn`` per token (norms, ``Q``/``K``/``V``, attention
out, gate, up, their product); from ``I`` to ``W`` the 2BP stash, each
weight's input and output gradient, ``5h + 2kv + 4 ffn`` per token minus what
is shared. These are estimates of the usual autograd layout, not measurements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class DecoderShape:
    """The shapes of a decoder of identical blocks.

    Args:
        name: for the output.
        layers, hidden, heads, ffn, vocab: the usual sizes.
        kv_heads: heads of ``K`` and ``V`` (grouped-query attention); ``heads``: none.
        experts: routed SwiGLU experts per layer (0: dense); ``top_k`` of them per token.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int | None = None
    experts: int = 0
    top_k: int = 2

    @property
    def kv_width(self) -> int:
        """Width of ``K`` (and of ``V``)."""
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    @property
    def block_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP or experts, two norms)."""
        h = self.hidden
        attention = 2 * h * h + 2 * h * self.kv_width
        mlp = 3 * h * self.ffn
        if self.experts:
            mlp = mlp * self.experts + h * self.experts
        return attention + mlp + 2 * h

    @property
    def active_block_params(self) -> int:
        """Parameters one token goes through in a layer (``top_k`` experts)."""
        if not self.experts:
            return self.block_params
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_width + 3 * h * self.ffn * self.top_k + 2 * h

    @property
    def params(self) -> int:
        """All parameters: the layers, embedding, final norm and an untied head."""
        return self.layers * self.block_params + 2 * self.vocab * self.hidden + self.hidden


PRESETS: dict[str, dict[str, DecoderShape]] = {
    "llama": {
        # LLaMA-2 (Touvron et al. 2023, Table 1; the Hugging Face configs).
        "7b": DecoderShape("llama-7b", 32, 4096, 32, 11008, 32000),
        "13b": DecoderShape("llama-13b", 40, 5120, 40, 13824, 32000),
        "70b": DecoderShape("llama-70b", 80, 8192, 64, 28672, 32000, kv_heads=8),
    },
}


def decoder_shape(model: str, size: str) -> DecoderShape:
    """A named preset.

    Raises:
        ValueError: naming the families and sizes there are.
    """
    family = PRESETS.get(model)
    if family is None or size not in family:
        known = ", ".join(f"{m} {'/'.join(s)}" for m, s in PRESETS.items())
        raise ValueError(f"no analytic shapes for {model} {size}; known: {known}")
    return family[size]


SHAPE_FIELDS = ("layers", "hidden", "heads", "ffn", "vocab", "kv_heads", "experts", "top_k")
"""The fields of :class:`DecoderShape` a user may give (``--layers`` ...)."""
REQUIRED_FIELDS = SHAPE_FIELDS[:5]
HF_KEYS: dict[str, str] = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "ffn": "intermediate_size",
    "vocab": "vocab_size",
    "kv_heads": "num_key_value_heads",
    "experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
}
"""Where a Hugging Face ``config.json`` of a LLaMA-like decoder (LLaMA, Mistral,
Qwen2, Mixtral) keeps each field."""


def custom_shape(name: str, **fields: int | None) -> DecoderShape:
    """A decoder of the given sizes (``None``: the field's default).

    Raises:
        ValueError: a required size missing, a size below 1, or heads that do
            not divide the width (or key-value heads the heads).
    """
    given = {k: v for k, v in fields.items() if v is not None}
    unknown = sorted(set(given) - set(SHAPE_FIELDS))
    if unknown:
        raise ValueError(f"unknown decoder sizes {unknown}; known: {', '.join(SHAPE_FIELDS)}")
    missing = [k for k in REQUIRED_FIELDS if k not in given]
    if missing:
        flags = " ".join(f"--{k.replace('_', '-')}" for k in missing)
        raise ValueError(f"a custom decoder needs {flags} too (or --model, or --hf-config)")
    low = [f"{k}={v}" for k, v in given.items() if v < (0 if k == "experts" else 1)]
    if low:
        raise ValueError(f"decoder sizes must be at least 1 (experts: 0): {', '.join(low)}")
    shape = DecoderShape(name=name, **given)  # type: ignore[arg-type]
    if shape.hidden % shape.heads:
        raise ValueError(f"{shape.heads} heads do not divide the width {shape.hidden}")
    if shape.kv_heads is not None and shape.heads % shape.kv_heads:
        raise ValueError(f"{shape.kv_heads} key-value heads do not divide {shape.heads} heads")
    if shape.experts and shape.top_k > shape.experts:
        raise ValueError(f"top_k {shape.top_k} is more than the {shape.experts} experts")
    return shape


def hf_shape(config: Mapping[str, Any], name: str) -> DecoderShape:
    """The shape of a Hugging Face decoder from its ``config.json``.

    Raises:
        ValueError: naming the keys a LLaMA-like configuration has and this one lacks.
    """
    missing = [HF_KEYS[k] for k in REQUIRED_FIELDS if HF_KEYS[k] not in config]
    if missing:
        raise ValueError(
            f"{name} is not a LLaMA-like decoder configuration: no {', '.join(missing)}"
        )
    fields = {k: config.get(hf) for k, hf in HF_KEYS.items()}
    return custom_shape(name, **{k: int(v) for k, v in fields.items() if v is not None})


@dataclass(frozen=True)
class BlockCosts:
    """One layer's FLOPs and bytes for one micro-batch of ``tokens`` tokens.

    ``*_matmul`` are the weight matrices' FLOPs, ``*_attention`` attention's
    scores and values; ``activation_bytes`` are held from ``F`` to ``I``,
    ``stash_bytes`` from ``I`` to ``W`` (2BP); ``send_bytes`` cross a stage boundary.
    Parameters, gradients and optimizer state are per layer, in bytes.
    """

    forward_matmul: float
    forward_attention: float
    input_matmul: float
    input_attention: float
    weight_matmul: float
    activation_bytes: float
    stash_bytes: float
    send_bytes: float
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float

    @property
    def forward(self) -> float:
        return self.forward_matmul + self.forward_attention

    @property
    def backward_input(self) -> float:
        return self.input_matmul + self.input_attention

    @property
    def backward_weight(self) -> float:
        return self.weight_matmul


def block_costs(
    shape: DecoderShape, seq_len: int, microbatch: int, dtype: str = "bfloat16", tensor: int = 1
) -> BlockCosts:
    """One layer's costs on one of ``tensor`` tensor-parallel ranks.

    Mixed precision: weights and gradients in ``dtype``, AdamW's two moments
    and (below float32) a float32 master copy: 8 or 12 bytes per parameter.
    Tensor parallelism divides FLOPs, weights and (with sequence parallelism)
    the held activations by ``tensor``.
    """
    size = DTYPE_BYTES[dtype]
    tokens = seq_len * microbatch
    h, kv, ffn = shape.hidden, shape.kv_width, shape.ffn
    active = shape.active_block_params - 2 * h
    matmul = 2.0 * active * tokens / tensor
    attention = 4.0 * seq_len * h * tokens / tensor
    routed = shape.top_k if shape.experts else 1
    act = (6 * h + 2 * kv + 4 * ffn * routed) * tokens * size / tensor
    stash = (5 * h + 2 * kv + 4 * ffn * routed) * tokens * size / tensor
    params = shape.block_params / tensor
    optimizer = 8 if size == 4 else 12
    return BlockCosts(
        forward_matmul=matmul,
        forward_attention=attention,
        input_matmul=matmul,
        input_attention=2 * attention,
        weight_matmul=matmul,
        activation_bytes=act,
        stash_bytes=stash,
        send_bytes=h * tokens * size,
        parameter_bytes=params * size,
        gradient_bytes=params * size,
        optimizer_bytes=params * optimizer,
    )


def head_costs(
    shape: DecoderShape, seq_len: int, microbatch: int, dtype: str = "bfloat16", tensor: int = 1
) -> BlockCosts:
    """The output head's costs (final norm and an untied ``vocab x hidden`` projection,
    vocabulary-parallel over ``tensor`` ranks) for one micro-batch.

    Its matrix costs ``2 V h`` per token in each of ``F``, ``I`` and ``W``; it
    holds its input and the logits from ``F`` to ``I`` and their gradient to ``W``.
    """
    size = DTYPE_BYTES[dtype]
    tokens = seq_len * microbatch
    h, vocab = shape.hidden, shape.vocab
    matmul = 2.0 * vocab * h * tokens / tensor
    params = (vocab * h + h) / tensor
    optimizer = 8 if size == 4 else 12
    return BlockCosts(
        forward_matmul=matmul,
        forward_attention=0.0,
        input_matmul=matmul,
        input_attention=0.0,
        weight_matmul=matmul,
        activation_bytes=(h + vocab / tensor) * tokens * size,
        stash_bytes=(h + vocab / tensor) * tokens * size,
        send_bytes=0.0,
        parameter_bytes=params * size,
        gradient_bytes=params * size,
        optimizer_bytes=params * optimizer,
    )


def step_flops(shape: DecoderShape, tokens: int, seq_len: int) -> float:
    """FLOPs of one training step over ``tokens`` tokens (layers and head)."""
    per_layer = block_costs(shape, seq_len, 1)
    layer = per_layer.forward + per_layer.backward_input + per_layer.backward_weight
    head = 6.0 * shape.vocab * shape.hidden * seq_len
    return (shape.layers * layer + head) * tokens / seq_len
