"""A pipeline of ``blocks(model)`` back to the Hugging Face model it was cut from.

A checkpoint of a pipeline names its tensors as ``nn.Sequential(*blocks)``
does (``0.wte.weight``, ``1.block.ln_1.weight``): the wrapper blocks'
names, which ``GPT2LMHeadModel.load_state_dict`` does not know.
:func:`model_state_dict` maps them back: :func:`twobp.integrations.transformers.blocks`
wraps the model's own parameters and buffers, so each block entry *is* one
of the model's tensors, and its name in the model is found by identity. A
weight the model ties (the head and the token embedding) comes back under
each of its names, as ``model.state_dict()`` gives it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from itertools import chain

from torch import Tensor, nn


class ExportError(ValueError):
    """The checkpoint does not hold the model's weights (the message names what is missing)."""


def block_names(model: nn.Module) -> dict[int, list[str]]:
    """For each tensor of ``model`` that its blocks hold, every name the blocks give it."""
    from twobp.integrations.transformers import blocks

    parts = blocks(model)
    named = chain(
        parts.named_parameters(remove_duplicate=False), parts.named_buffers(remove_duplicate=False)
    )
    found: dict[int, list[str]] = {}
    for name, tensor in named:
        found.setdefault(id(tensor), []).append(name)
    return found


def model_state_dict(
    model: nn.Module, checkpoint: str | os.PathLike[str] | Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """The model's state dict, by its own names, from a checkpoint of a pipeline of its blocks.

    Args:
        model: the model whose ``blocks(model)`` the pipeline ran (built as it was: the
            same configuration; its values are not read).
        checkpoint: the checkpoint folder a pipeline saved (or a folder of them: the
            latest), or the merged state dict of one (:func:`twobp.runtime.state.checkpoint.merge`).

    Returns:
        Every entry of ``model.state_dict()``, with the checkpoint's values:
        ``model.load_state_dict(result, strict=True)`` loads it, and
        ``model.save_pretrained`` then writes a folder ``from_pretrained`` reads.
        A buffer no block holds (none of the model's weights) keeps the model's value.

    Raises:
        ExportError: if a parameter of the model is in no block or not in the
            checkpoint, or a shape differs (another configuration).
        twobp.runtime.CheckpointError: if the checkpoint cannot be read.
    """
    saved = _merged(checkpoint)
    names = block_names(model)
    parameters = {id(p) for p in model.parameters()}
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        held = [n for n in names.get(id(tensor), []) if n in saved]
        if not held:
            if id(tensor) not in parameters:
                out[name] = tensor.detach().clone()
                continue
            where = (
                "in no block of blocks(model)"
                if id(tensor) not in names
                else (f"saved as {names[id(tensor)][0]!r}, which the checkpoint does not hold")
            )
            raise ExportError(
                f"the model's {name} is {where}: pass the model the pipeline was built from "
                "(the same configuration) and a checkpoint of that pipeline"
            )
        value = saved[held[0]]
        if value.shape != tensor.shape:
            raise ExportError(
                f"the checkpoint's {held[0]} has shape {tuple(value.shape)} but the model's "
                f"{name} has {tuple(tensor.shape)}: build the model with the configuration "
                "the pipeline was trained with"
            )
        out[name] = value.to(tensor.dtype)
    return out


def _merged(checkpoint: str | os.PathLike[str] | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The merged state dict of a checkpoint folder (or the one given)."""
    if isinstance(checkpoint, Mapping):
        return dict(checkpoint)
    from twobp.runtime.state.checkpoint import merge

    return merge(checkpoint)


def save_pretrained(
    model: nn.Module,
    checkpoint: str | os.PathLike[str] | Mapping[str, Tensor],
    folder: str | os.PathLike[str],
) -> nn.Module:
    """Load a pipeline checkpoint into ``model`` (strictly), in the checkpoint's floating
    dtype, and write it with its own ``save_pretrained(folder)``, which
    ``from_pretrained(folder)`` reads back.

    Returns:
        The model, with the checkpoint's weights and dtype.

    Raises:
        ExportError: see :func:`model_state_dict`.
    """
    saved = _merged(checkpoint)
    floating = [v.dtype for v in saved.values() if v.is_floating_point()]
    if floating:
        model.to(floating[0])
    model.load_state_dict(model_state_dict(model, saved), strict=True)
    save = getattr(model, "save_pretrained", None)
    if save is None:
        raise ExportError(
            f"{type(model).__name__} has no save_pretrained: it is not a "
            "transformers model; save model.state_dict() with torch.save instead"
        )
    save(os.fspath(folder))
    return model
