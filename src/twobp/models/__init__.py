"""Reference models of the 2BP paper, as ordered lists of pipeline blocks.

Six families, each a function returning its blocks and a ``build_*`` function
returning a :class:`ModelSpec` (blocks, block kinds, example data, loss):
LLaMA-like decoder, BERT-like encoder, Mamba-like state-space model,
bottleneck ResNet, DeepSpeech-2-like speech recogniser and a mixture-of-experts
decoder. :func:`build_model`
builds any of them from a named size.
"""

from twobp.models.bert import BertConfig, bert_blocks, build_bert, mask_tokens, mlm_loss
from twobp.models.common import build_blocks, lm_loss
from twobp.models.deepspeech import (
    DeepSpeechConfig,
    build_deepspeech,
    ctc_loss,
    deepspeech_blocks,
)
from twobp.models.llama import LlamaConfig, build_llama, llama_blocks
from twobp.models.mamba import MambaConfig, build_mamba, mamba_blocks, selective_scan
from twobp.models.moe import MoeConfig, MoeLoss, build_moe, moe_blocks
from twobp.models.presets import PAPER_SIZES, PRESETS, build_model
from twobp.models.resnet import ResNetConfig, build_resnet, classification_loss, resnet_blocks
from twobp.models.spec import BlockKind, ModelSpec
from twobp.models.tensor_parallel import shard_block, tensor_parallel_plan

__all__ = [
    "PAPER_SIZES",
    "PRESETS",
    "BertConfig",
    "BlockKind",
    "DeepSpeechConfig",
    "LlamaConfig",
    "MambaConfig",
    "ModelSpec",
    "MoeConfig",
    "MoeLoss",
    "ResNetConfig",
    "bert_blocks",
    "build_bert",
    "build_blocks",
    "build_deepspeech",
    "build_llama",
    "build_mamba",
    "build_model",
    "build_moe",
    "build_resnet",
    "classification_loss",
    "ctc_loss",
    "deepspeech_blocks",
    "llama_blocks",
    "lm_loss",
    "mamba_blocks",
    "mask_tokens",
    "mlm_loss",
    "moe_blocks",
    "resnet_blocks",
    "selective_scan",
    "shard_block",
    "tensor_parallel_plan",
]
