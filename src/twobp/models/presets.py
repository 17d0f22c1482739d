"""Named sizes of the reference families, and ``build_model`` to build one.

``tiny`` and ``small`` train on a CPU in seconds to minutes; the paper's sizes
(``llama/7b``, ``bert/large``, ``mamba/1.4b``, ``resnet/152``) are meant for
GPUs, and build on ``device="meta"`` without allocating memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from twobp.models.bert import BertConfig, build_bert
from twobp.models.common import Device
from twobp.models.deepspeech import DeepSpeechConfig, build_deepspeech
from twobp.models.llama import LlamaConfig, build_llama
from twobp.models.mamba import MambaConfig, build_mamba
from twobp.models.moe import MoeConfig, build_moe
from twobp.models.resnet import ResNetConfig, build_resnet
from twobp.models.spec import ModelSpec

# Byte-level text (256 ids) fits the tiny and small language models; BERT adds
# a few special ids so that its [MASK] (the last id) is not a byte.
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "llama": MappingProxyType(
            {
                "tiny": LlamaConfig(256, dim=64, n_layers=4, n_heads=4, ffn_dim=176, seq_len=32),
                "small": LlamaConfig(256, dim=256, n_layers=8, n_heads=8, ffn_dim=688, seq_len=128),
                "7b": LlamaConfig(
                    32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, seq_len=1024
                ),
            }
        ),
        "bert": MappingProxyType(
            {
                "tiny": BertConfig(260, dim=64, n_layers=4, n_heads=4, ffn_dim=256, seq_len=32),
                "small": BertConfig(260, dim=256, n_layers=8, n_heads=4, ffn_dim=1024, seq_len=128),
                "large": BertConfig(
                    30522, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096, seq_len=512
                ),
            }
        ),
        "mamba": MappingProxyType(
            {
                "tiny": MambaConfig(256, d_model=64, n_layers=4, seq_len=32, d_state=8),
                "small": MambaConfig(256, d_model=256, n_layers=8, seq_len=128),
                # Mamba-1.4B: vocabulary 50277 padded to a multiple of 8.
                "1.4b": MambaConfig(50280, d_model=2048, n_layers=48, seq_len=1024),
            }
        ),
        "resnet": MappingProxyType(
            {
                "tiny": ResNetConfig((1, 1, 1, 1), width=8, image_size=32, num_classes=10),
                "small": ResNetConfig((2, 2, 2, 2), width=16, image_size=64, num_classes=100),
                "50": ResNetConfig((3, 4, 6, 3)),
                "152": ResNetConfig((3, 8, 36, 3)),
            }
        ),
        "moe": MappingProxyType(
            {
                "tiny": MoeConfig(
                    256, dim=64, n_layers=4, n_heads=4, ffn_dim=64, n_experts=8, top_k=2, seq_len=32
                ),
                "small": MoeConfig(
                    256,
                    dim=256,
                    n_layers=8,
                    n_heads=8,
                    ffn_dim=256,
                    n_experts=8,
                    top_k=2,
                    seq_len=128,
                    shared_ffn_dim=256,
                ),
                # Mixtral-8x7B's sizes (its grouped-query attention is full attention here).
                "8x7b": MoeConfig(
                    32000,
                    dim=4096,
                    n_layers=32,
                    n_heads=32,
                    ffn_dim=14336,
                    n_experts=8,
                    top_k=2,
                    seq_len=1024,
                ),
            }
        ),
        "deepspeech": MappingProxyType(
            {
                "tiny": DeepSpeechConfig(
                    16, n_features=16, channels=4, dim=32, n_layers=2, frames=48, label_len=6
                ),
                "small": DeepSpeechConfig(
                    29, n_features=64, channels=16, dim=256, n_layers=4, frames=128, label_len=16
                ),
                # DeepSpeech 2's English model: 7 bidirectional recurrent layers of 1760.
                "large": DeepSpeechConfig(),
            }
        ),
    }
)
"""``PRESETS[family][size]`` is the config dataclass of that size."""

PAPER_SIZES: Mapping[str, str] = MappingProxyType(
    {"llama": "7b", "bert": "large", "mamba": "1.4b", "resnet": "152"}
)
"""The size of each family that the 2BP paper measures (it measures no speech model)."""

_BUILDERS: Mapping[str, Callable[..., ModelSpec]] = MappingProxyType(
    {
        "llama": build_llama,
        "bert": build_bert,
        "mamba": build_mamba,
        "resnet": build_resnet,
        "deepspeech": build_deepspeech,
        "moe": build_moe,
    }
)


def build_model(
    family: str,
    size: str = "tiny",
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
    **overrides: Any,
) -> ModelSpec:
    """Build a reference model from a preset, optionally changing some of its fields.

    Args:
        family: ``"llama"``, ``"bert"``, ``"mamba"``, ``"resnet"``, ``"deepspeech"`` or ``"moe"``.
        size: a preset of that family (see :data:`PRESETS`); ``"paper"`` is the
            size the 2BP paper measures.
        device: where to build the parameters (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed, so two builds are equal (``None``: global RNG).
        **overrides: fields of the family's config to change, e.g.
            ``n_layers=2, seq_len=16``.

    Returns:
        The model spec: blocks, block kinds, example data and loss.

    Raises:
        ValueError: on an unknown family, size or config field.
    """
    if family not in PRESETS:
        raise ValueError(f"unknown model family {family!r}; choose from {', '.join(PRESETS)}")
    if size == "paper":
        if family not in PAPER_SIZES:
            raise ValueError(
                f"the 2BP paper measures no {family}; choose from {', '.join(PRESETS[family])}"
            )
        size = PAPER_SIZES[family]
    sizes = PRESETS[family]
    if size not in sizes:
        raise ValueError(
            f"unknown size {size!r} of {family}; choose from {', '.join(sizes)} or 'paper'"
        )
    config = sizes[size]
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"{family} has no config field(s) {', '.join(unknown)}; "
            f"fields are {', '.join(sorted(fields))}"
        )
    if "layers" in overrides:
        overrides["layers"] = tuple(overrides["layers"])
    config = dataclasses.replace(config, **overrides)
    return _BUILDERS[family](config, size, device=device, dtype=dtype, seed=seed)
