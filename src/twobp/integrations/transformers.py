"""Hugging Face ``transformers`` models as pipeline blocks.

:func:`blocks` cuts a model into an ``nn.Sequential`` of blocks: the embedding
(with positions where the model adds them), one block per decoder or encoder
layer, and the final norm with the head. Each layer block builds what its
model would pass the layer: rotary position embeddings, the causal or padding
mask in the form the model's attention implementation takes. The blocks share
the model's modules and parameters: nothing is copied.

A block takes and returns either the hidden states alone or a tuple
``(hidden_states, attention_mask)``: give the first block ``input_ids``, or
``(input_ids, attention_mask)`` with a padding mask (1 for tokens, 0 for
padding), and the mask travels with the hidden states to every layer. The
last block returns the logits; :func:`loss_function` gives the model's own
loss on them.

A mixture-of-experts model whose loss adds its routers' auxiliary load-balancing
loss (``config.output_router_logits`` on: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)
carries the routers' statistics along too (:mod:`twobp.integrations.router_loss`):
every block from the embedding on passes ``(hidden_states, probs, counts)``, or
``(hidden_states, attention_mask, probs, counts)``, each layer adding its routers'
tokens, and the last block returns ``(logits, probs, counts)``, from which
:func:`loss_function` adds the auxiliary loss as the model weighs it. A model whose
loss adds an auxiliary loss that twobp cannot compute is refused.

Covered layouts: LLaMA-family causal LMs (``LlamaForCausalLM`` and the models
laid out like it: ``model.embed_tokens``, ``model.layers``, ``model.norm``,
``lm_head``), GPT-2 (``GPT2LMHeadModel``), BERT as a masked LM
(``BertForMaskedLM``) and Mamba (``MambaForCausalLM``).

Tied weights stay tied: GPT-2, BERT and Mamba read the input embedding's
weight again in their head, so the first and the last block share that
parameter. A ``Pipeline`` that puts the two blocks on different ranks keeps
it one weight: each holder gets the sum of both uses' gradients (the ``R``
action of the schedule), so the values stay identical after every step.

``transformers`` is an optional dependency (``pip install twobp[transformers]``);
it is imported by the functions here, not by ``twobp``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from twobp.integrations import MIXTURE_FAMILIES, TRANSFORMERS_FAMILIES
from twobp.integrations.router_loss import RouterLoss, Sums, router_loss

Hidden = Tensor | tuple[Tensor, ...]
"""What blocks pass on: the hidden states, ``(hidden_states, attention_mask)``, and
with the routers' sums ``(hidden_states, probs, counts)`` or
``(hidden_states, attention_mask, probs, counts)``."""


def _split(x: Hidden) -> tuple[Tensor, Tensor | None, Sums | None]:
    if not isinstance(x, (tuple, list)):
        return x, None, None
    if len(x) == 2:
        return x[0], x[1], None
    if len(x) == 3:
        return x[0], None, (x[1], x[2])
    hidden, mask, probs, counts = x
    return hidden, mask, (probs, counts)


def _join(hidden: Tensor, mask: Tensor | None, sums: Sums | None = None) -> Hidden:
    parts = (hidden, *(() if mask is None else (mask,)), *(sums or ()))
    return parts if len(parts) > 1 else hidden


def _positions(hidden: Tensor) -> Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _mask_function(name: str) -> Callable[..., Any]:
    from transformers import masking_utils

    function: Callable[..., Any] = getattr(masking_utils, name)
    return function


def _without_cache(function: Callable[..., Any], **kwargs: Any) -> Any:
    """Call a mask builder of ``transformers.masking_utils`` with no cache, in any version:
    ``cache`` where it takes one (``past_key_values``, its deprecated name, is not passed
    too: that warns), else ``past_key_values``."""
    parameters = inspect.signature(function).parameters
    name = "cache" if "cache" in parameters else "past_key_values"
    if name in parameters:
        kwargs[name] = None
    return function(**kwargs)


class CausalMask(nn.Module):
    """The causal (and padding) mask a decoder model gives its layers, built from the hidden states.

    Args:
        config: the model's configuration (its attention implementation decides the form).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config

    def forward(self, hidden: Tensor, mask: Tensor | None, positions: Tensor) -> Any:
        return _without_cache(
            _mask_function("create_causal_mask"),
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=mask,
            position_ids=positions,
        )


class TokenEmbedding(nn.Module):
    """``embedding(input_ids)`` (LLaMA family, Mamba); with ``routing``, zero routers' sums too."""

    def __init__(self, embedding: nn.Module, routing: RouterLoss | None = None) -> None:
        super().__init__()
        self.embedding = embedding
        self.routing = routing

    def forward(self, x: Hidden) -> Hidden:
        ids, mask, _ = _split(x)
        hidden = self.embedding(ids)
        sums = None if self.routing is None else self.routing.start(hidden)
        return _join(hidden, mask, sums)


class DecoderLayer(nn.Module):
    """A LLaMA-family decoder layer with its rotary embedding and causal mask; given the
    routers' sums, it adds the rows of its own routers."""

    def __init__(
        self, layer: nn.Module, rotary: nn.Module, config: Any, routing: RouterLoss | None = None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.mask = CausalMask(config)
        self.routing = routing

    def forward(self, x: Hidden) -> Hidden:
        hidden, mask, sums = _split(x)
        positions = _positions(hidden)
        rotary = self.rotary(hidden, positions)
        recording: contextlib.AbstractContextManager[list[Tensor]] = contextlib.nullcontext([])
        if sums is not None and self.routing is not None:
            recording = self.routing.recorded(self.routing.routers(self.layer))
        with recording as logits:
            out = self.layer(
                hidden,
                attention_mask=self.mask(hidden, mask, positions),
                position_ids=positions,
                position_embeddings=rotary,
            )
        if sums is not None and self.routing is not None and logits:
            sums = self.routing.add(sums, logits, mask)
        return _join(out[0] if isinstance(out, tuple) else out, mask, sums)


class NormHead(nn.Module):
    """The final norm and the language-model head; returns the logits, followed by the
    routers' sums when it is given them."""

    def __init__(self, norm: nn.Module, head: nn.Module, float_logits: bool = False) -> None:
        super().__init__()
        self.norm = norm
        self.head = head
        self.float_logits = float_logits

    def forward(self, x: Hidden) -> Tensor | tuple[Tensor, ...]:
        hidden, _, sums = _split(x)
        logits = self._logits(self.norm(hidden))
        return logits if sums is None else (logits, *sums)

    def _logits(self, hidden: Tensor) -> Tensor:
        if self.float_logits:
            # Mamba: the head in its weight's dtype, the logits in float32 as the model
            # gives them, but float64 kept (the model's own rounds it to float32).
            head: Any = self.head
            logits: Tensor = head(hidden.to(head.weight.dtype))
            return logits if logits.dtype == torch.float64 else logits.float()
        out: Tensor = self.head(hidden)
        return out


class GPT2Embedding(nn.Module):
    """GPT-2's token plus position embeddings (and dropout)."""

    def __init__(self, transformer: Any) -> None:
        super().__init__()
        self.wte = transformer.wte
        self.wpe = transformer.wpe
        self.drop = transformer.drop

    def forward(self, x: Hidden) -> Hidden:
        ids, mask, _ = _split(x)
        tokens = self.wte(ids)
        hidden = tokens + self.wpe(_positions(tokens))
        return _join(self.drop(hidden), mask)


class GPT2Layer(nn.Module):
    """A GPT-2 block with its causal mask."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.mask = CausalMask(config)

    def forward(self, x: Hidden) -> Hidden:
        hidden, mask, _ = _split(x)
        out = self.block(hidden, attention_mask=self.mask(hidden, mask, _positions(hidden)))
        return _join(out[0] if isinstance(out, tuple) else out, mask)


class BertEmbedding(nn.Module):
    """BERT's embeddings: words, positions, token types, LayerNorm and dropout."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, x: Hidden) -> Hidden:
        ids, mask, _ = _split(x)
        return _join(self.embeddings(input_ids=ids), mask)


class BertLayer(nn.Module):
    """A BERT encoder layer with its (bidirectional) padding mask."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, x: Hidden) -> Hidden:
        hidden, mask, _ = _split(x)
        extended = _without_cache(
            _mask_function("create_bidirectional_mask"),
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=mask,
        )
        out = self.layer(hidden, attention_mask=extended)
        return _join(out[0] if isinstance(out, tuple) else out, mask)


class BertHead(nn.Module):
    """BERT's masked-LM head (transform, then the decoder tied to the word embeddings)."""

    def __init__(self, cls: nn.Module) -> None:
        super().__init__()
        self.cls = cls

    def forward(self, x: Hidden) -> Tensor:
        hidden, _, _ = _split(x)
        out: Tensor = self.cls(hidden)
        return out


class MambaLayer(nn.Module):
    """A Mamba block; the padding mask (if any) zeroes padded positions as the model does."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Hidden) -> Hidden:
        hidden, mask, _ = _split(x)
        return _join(self.block(hidden, attention_mask=mask), mask)


def _get(model: nn.Module, path: str) -> Any:
    value: Any = model
    for name in path.split("."):
        value = getattr(value, name, None)
        if value is None:
            return None
    return value


def _has(model: nn.Module, *paths: str) -> bool:
    return all(_get(model, p) is not None for p in paths)


def _is_speech(model: nn.Module) -> bool:
    """Whether ``model`` is a speech model with a CTC head (``Wav2Vec2ForCTC``,
    ``HubertForCTC``): :mod:`twobp.integrations.wav2vec2` cuts them and gives their loss."""
    from twobp.integrations.wav2vec2 import speech_family

    return speech_family(model) is not None


def family(model: nn.Module) -> str:
    """Which covered layout ``model`` has: ``"llama"``, ``"gpt2"``, ``"bert"`` or ``"mamba"``.

    Raises:
        ValueError: if the model is laid out otherwise.
    """
    if _has(model, "model.embed_tokens", "model.layers", "model.norm", "lm_head"):
        return "llama"
    if _has(model, "transformer.wte", "transformer.wpe", "transformer.h", "lm_head"):
        return "gpt2"
    if _has(model, "bert.embeddings", "bert.encoder.layer", "cls.predictions"):
        return "bert"
    if _has(model, "backbone.embeddings", "backbone.layers", "backbone.norm_f", "lm_head"):
        return "mamba"
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    hint = (
        "; an encoder-decoder is two pipelines' worth of blocks that this does not guess: "
        "write its blocks yourself (docs/user-guide.md, 'Encoder-decoder models')"
        if encoder_decoder
        else ""
    )
    raise ValueError(
        f"twobp.integrations.transformers does not know how to cut a {type(model).__name__}: "
        f"it covers LLaMA-family causal LMs (model.embed_tokens, model.layers, model.norm, "
        f"lm_head: Llama, Qwen2/3, Mistral, Mixtral, Qwen-MoE...), GPT2LMHeadModel, "
        f"BertForMaskedLM and MambaForCausalLM, and the CTC speech models{hint}"
    )


def blocks(model: nn.Module) -> nn.Sequential:
    """Cut a ``transformers`` model into pipeline blocks.

    Args:
        model: a LLaMA-family causal LM, ``GPT2LMHeadModel``,
            ``BertForMaskedLM`` or ``MambaForCausalLM``.

    Returns:
        The embedding block, one block per layer, and the norm-and-head
        block, sharing the model's modules. The first takes ``input_ids`` or
        ``(input_ids, attention_mask)``; the last returns the logits, or
        ``(logits, probs, counts)`` for a model whose loss adds its routers'
        auxiliary loss (see :mod:`twobp.integrations.router_loss`).

    Raises:
        ValueError: if the model is laid out otherwise, or its loss adds an
            auxiliary loss that twobp cannot compute.
    """
    if _is_speech(model):
        from twobp.integrations import wav2vec2

        return wav2vec2.blocks(model)
    kind = family(model)
    hf: Any = model
    config: Any = hf.config
    routing = router_loss(model)
    parts: list[nn.Module]
    if kind == "llama":
        inner = hf.model
        parts = [TokenEmbedding(inner.embed_tokens, routing)]
        parts += [DecoderLayer(layer, inner.rotary_emb, config, routing) for layer in inner.layers]
        parts.append(NormHead(inner.norm, hf.lm_head))
    elif kind == "gpt2":
        transformer = hf.transformer
        parts = [GPT2Embedding(transformer)]
        parts += [GPT2Layer(block, config) for block in transformer.h]
        parts.append(NormHead(transformer.ln_f, hf.lm_head))
    elif kind == "bert":
        bert = hf.bert
        parts = [BertEmbedding(bert.embeddings)]
        parts += [BertLayer(layer, config) for layer in bert.encoder.layer]
        parts.append(BertHead(hf.cls))
    else:
        backbone = hf.backbone
        parts = [TokenEmbedding(backbone.embeddings)]
        parts += [MambaLayer(block) for block in backbone.layers]
        parts.append(NormHead(backbone.norm_f, hf.lm_head, float_logits=True))
    return nn.Sequential(*parts)


SIZES: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 97, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128},
    "small": {
        "vocab_size": 1024,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 688,
    },
}
"""Model sizes that :func:`build_model` knows (4 attention heads, 64 positions)."""

FAMILIES = TRANSFORMERS_FAMILIES
"""The layouts :func:`blocks` covers, by the name :func:`family` gives them."""


def n_blocks(size: str) -> int:
    """The blocks :func:`blocks` cuts a :func:`build_model` model of ``size`` into:
    the embedding, one per layer, the head."""
    return SIZES[size]["num_hidden_layers"] + 2


def build_model(
    kind: str,
    size: str = "tiny",
    *,
    tied: bool = True,
    vocab_size: int | None = None,
    max_positions: int = 64,
) -> nn.Module:
    """A freshly initialised model of a covered family, from a small configuration (no download).

    Dropout is off, so that a pipeline and the model compute the same.

    Args:
        kind: ``"llama"``, ``"gpt2"``, ``"bert"``, ``"mamba"`` or ``"mixtral"`` (4 experts,
            top 2, its routers' auxiliary loss on, eager experts).
        size: a key of :data:`SIZES`.
        tied: tie the output layer to the input embedding where the family does
            by default (GPT-2, BERT, Mamba; LLaMA never ties). False gives the
            first and the last block parameters of their own.
        vocab_size: the vocabulary (default: the size's).
        max_positions: the longest sequence (GPT-2 and BERT learn a position
            embedding of this many rows; LLaMA's rotary embedding takes it as a hint).

    Raises:
        ValueError: for an unknown family or size.
    """
    import transformers

    kinds = (*FAMILIES, *MIXTURE_FAMILIES)
    if kind not in kinds or size not in SIZES:
        raise ValueError(f"build_model takes a family of {kinds} and a size of {list(SIZES)}")
    dims = SIZES[size]
    vocab = dims["vocab_size"] if vocab_size is None else vocab_size
    hidden, layers = dims["hidden_size"], dims["num_hidden_layers"]
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "tie_word_embeddings": tied and kind not in ("llama", "mixtral"),
    }
    # The LLaMA family's decoder (Mixtral's experts each of this width).
    decoder: dict[str, Any] = {
        "intermediate_size": dims["intermediate_size"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_positions,
        **common,
    }
    model: nn.Module
    if kind == "mixtral":
        mixtral = transformers.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, **decoder
        )
        # Plain products per expert (grouped_mm takes no float64 on the CPU).
        mixtral.experts_implementation = "eager"
        model = transformers.MixtralForCausalLM(mixtral)
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder))
    elif kind == "gpt2":
        gpt2 = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=max_positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=common["tie_word_embeddings"],
        )
        model = transformers.GPT2LMHeadModel(gpt2)
    elif kind == "bert":
        bert = transformers.BertConfig(
            intermediate_size=dims["intermediate_size"],
            num_attention_heads=4,
            max_position_embeddings=max_positions,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        model = transformers.BertForMaskedLM(bert)
    else:
        model = transformers.MambaForCausalLM(transformers.MambaConfig(state_size=16, **common))
    return model


def state_dict(model: nn.Module, checkpoint: Any) -> dict[str, Tensor]:
    """The model's own state dict from a checkpoint of a pipeline of ``blocks(model)``: by the
    model's names, ties kept, so that ``model.load_state_dict(..., strict=True)`` and then
    ``model.save_pretrained`` give a folder ``from_pretrained`` reads
    (:func:`twobp.integrations.hf_export.model_state_dict`)."""
    from twobp.integrations.hf_export import model_state_dict

    return model_state_dict(model, checkpoint)


def loss_function(model: nn.Module) -> Callable[[Any, Tensor], Tensor]:
    """``loss(output, labels)``: the loss the model computes itself when given ``labels``.

    ``output`` is what the last of :func:`blocks` returns: the logits, or
    ``(logits, probs, counts)`` for a model whose loss adds its routers'
    auxiliary loss, which it adds as the model does: ``router_aux_loss_coef``
    times ``load_balancing_loss_func`` of every layer's router logits and the
    attention mask (see :mod:`twobp.integrations.router_loss`; per micro-batch).

    Causal LMs shift the labels (token ``t`` predicts ``t + 1``); BERT's masked
    LM does not. Labels of ``-100`` are ignored. Like the model's own loss, it
    takes logits of lower precision up to float32; float64 logits stay float64
    (the model's own loss would round them to float32).

    Args:
        model: a model :func:`blocks` covers.

    Raises:
        ValueError: if the model's loss adds an auxiliary loss that twobp cannot
            compute; the loss itself, if ``output`` lacks the routers' sums the
            model's loss needs, or carries sums it does not.
    """
    if _is_speech(model):
        from twobp.integrations import wav2vec2

        return wav2vec2.loss_function(model)  # type: ignore[return-value]  # (sum, count)
    kind = family(model)
    hf: Any = model
    vocab_size: int = hf.config.vocab_size
    shift = kind != "bert"
    routing = router_loss(model)
    name = type(model).__name__

    def loss(output: Any, labels: Tensor) -> Tensor:
        logits, sums = _logits_and_sums(output, routing is not None, name)
        if logits.dtype != torch.float64:
            logits = logits.float()
        if shift:
            labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        out: Tensor = nn.functional.cross_entropy(
            logits.reshape(-1, vocab_size), labels.reshape(-1).to(logits.device)
        )
        if routing is not None and sums is not None:
            out = out + routing.coefficient * routing.loss(*sums).to(out.device)
        return out

    return loss


def _logits_and_sums(output: Any, routed: bool, name: str) -> tuple[Tensor, Sums | None]:
    """The logits and the routers' sums of the last block's output, checked against
    whether the model's loss adds its routers' auxiliary loss."""
    if routed and isinstance(output, (tuple, list)) and len(output) == 3:
        logits, probs, counts = output
        return logits, (probs, counts)
    if not routed and isinstance(output, Tensor):
        return output, None
    got = type(output).__name__
    if isinstance(output, (tuple, list)):
        got += f" of {len(output)}"
    if routed:
        raise ValueError(
            f"the loss of this {name} adds its routers' auxiliary loss "
            "(config.output_router_logits is on), so it takes the last block's "
            f"(logits, probs, counts), got a {got}: make blocks(model) and "
            "loss_function(model) under the same config.output_router_logits"
        )
    raise ValueError(
        f"the loss of this {name} adds no routers' auxiliary loss, so it takes the logits, "
        f"got a {got}: pass it the output of the last of blocks(model), made under the "
        "same configuration (config.output_router_logits)"
    )


_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_gather_output",
    "embedding_rowwise": "embedding_rowwise",
}
"""Hugging Face's tensor-parallel styles twobp splits alike (``"colwise_rep"``: the name of
``"colwise_gather_output"`` before transformers 5)."""
_HEAD_STYLES = ("colwise_gather_output", "colwise_rep")
LOSS_PARALLEL = "colwise_loss_parallel"
"""twobp's column-parallel head whose logits stay split (``twobp.models.tensor_parallel``)."""


def tensor_parallel_plan(
    model: nn.Module, *, loss_parallel: bool = False, vocabulary: bool = True
) -> dict[str, str]:
    """The tensor-parallel plan of :func:`blocks` of a model, from the model's own plan.

    The model's plan (``model.tp_plan``: its class's ``_tp_plan``, such as ``"lm_head":
    "colwise_gather_output"``, and its configuration's ``base_model_tp_plan`` under the base
    model, such as ``"model.layers.*.self_attn.q_proj": "colwise"`` and ``"model.embed_tokens":
    "embedding_rowwise"``) names modules of the whole model; each entry becomes the names the
    same modules have inside the blocks that :func:`blocks` cuts (``layer.self_attn.q_proj``
    in every decoder block, ``embedding`` in the first, ``head`` in the last), for
    ``Pipeline(tensor_parallel_plan=...)``. A head tied to the embedding is split with it.

    Args:
        model: a Hugging Face model of a covered family that has a plan.
        loss_parallel: the head's logits left split by vocabulary for the vocabulary-parallel
            cross-entropy (``"colwise_loss_parallel"``; :func:`loss_function` runs on them)
            instead of gathered before the loss.
        vocabulary: split the embedding and the head as the plan says (False: the decoder
            blocks only, the embedding and the head whole on every rank).

    Returns:
        A mapping from module-name pattern inside a block to a style of
        :data:`twobp.models.tensor_parallel.STYLES`.

    Raises:
        ValueError: if the model has no plan, an entry is of a style twobp does not split
            (other than ``"replicate"``, which leaves the module whole) or names no module of
            the blocks, or ``loss_parallel`` is asked of a plan without a gathered head; it
            names the entry.
    """
    name = type(model).__name__
    source = _model_plan(model)
    parts = list(blocks(model))
    inside: dict[int, tuple[int, str]] = {}  # id(module) -> (block, its name there)
    for index, block in enumerate(parts):
        for local, module in block.named_modules():
            if local:
                inside.setdefault(id(module), (index, local))
    modules = dict(model.named_modules())
    plan: dict[str, str] = {}
    for pattern, style in source.items():
        if style == "replicate":
            continue
        if style not in _STYLES:
            raise ValueError(
                f"tensor_parallel_plan: the entry {pattern!r}: {style!r} of {name}'s plan is "
                f"not supported (twobp splits {sorted(_STYLES)}); pass a plan of your own"
            )
        ours = LOSS_PARALLEL if loss_parallel and style in _HEAD_STYLES else _STYLES[style]
        found = [inside.get(id(m)) for n, m in modules.items() if fnmatch.fnmatchcase(n, pattern)]
        if not found or None in found:
            raise ValueError(
                f"tensor_parallel_plan: the entry {pattern!r}: {style!r} of {name}'s plan names "
                "no module of blocks(model) (or one they leave out); pass a plan of your own"
            )
        for index, local in filter(None, found):
            if vocabulary or 0 < index < len(parts) - 1:
                plan[local] = ours
    if loss_parallel and LOSS_PARALLEL not in plan.values():
        raise ValueError(
            f"tensor_parallel_plan: loss_parallel=True, but {name}'s plan has no head whose "
            f"logits it gathers ({' or '.join(_HEAD_STYLES)}) to leave split"
        )
    return plan


def _model_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan by the names of its modules: the instance's merged
    plan (transformers 5), else its class's with the configuration's under the base model."""
    merged = getattr(model, "_tp_plan", None)
    if merged:
        return dict(merged)
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix + "." if prefix and hasattr(model, prefix) else ""
    plan.update({inner + pattern: style for pattern, style in base.items()})
    if not plan:
        raise ValueError(
            f"tensor_parallel_plan: {type(model).__name__} has no tensor-parallel plan "
            "(tp_plan, base_model_tp_plan); pass a plan of your own"
        )
    return plan
