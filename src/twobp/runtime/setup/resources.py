"""What a pipeline is built on, checked as it is built: its device, autocast and scaler."""

from __future__ import annotations

import torch

from twobp.engine.autocast import check_autocast_dtype
from twobp.runtime.base.group import Membership, default_device, device_for
from twobp.runtime.errors import PipelineConfigError
from twobp.runtime.state.grad_scaler import GradScaler


def rank_device(requested: torch.device | None, members: Membership) -> torch.device:
    """This rank's device: the one asked for, or the group's (see ``device_for``); a CUDA
    device becomes the current one (collectives of objects use it)."""
    device = requested if requested is not None else device_for(members)
    if device.type == "cuda":
        if device.index is None:
            device = default_device()
        torch.cuda.set_device(device)
    return device


def check_autocast(device: torch.device, dtype: torch.dtype | None, rank: int) -> None:
    """Refuse an autocast dtype the device cannot run, naming the rank."""
    if dtype is None:
        return
    try:
        check_autocast_dtype(device, dtype)
    except ValueError as error:
        raise PipelineConfigError(f"rank {rank}: autocast={dtype}: {error}") from None


def check_grad_scaler(scaler: object, pipe: object) -> None:
    """Refuse a scaler that cannot agree across ranks, or that another pipeline holds, at once."""
    if scaler is None:
        return
    if isinstance(scaler, GradScaler):
        if scaler.belongs_elsewhere(pipe):
            raise PipelineConfigError(
                "grad_scaler belongs to another open pipeline: close that one first "
                "(pipe.close()), or give each pipeline its own twobp.GradScaler"
            )
        return
    if isinstance(scaler, torch.amp.GradScaler):
        raise PipelineConfigError(
            "grad_scaler is a torch.amp.GradScaler, which looks only at this rank's gradients "
            "(one rank would skip a step that another applies); use twobp.GradScaler, which "
            "takes the same arguments and methods"
        )
    raise PipelineConfigError(
        f"grad_scaler must be a twobp.GradScaler or None, not {type(scaler).__name__}"
    )
