"""A ResNet with bottleneck blocks (ResNet-50/101/152 style), cut into pipeline blocks.

Blocks, in order::

    Stem                        images (B, C, H, W)  -> features (B, 64w, H/4, W/4)
    Bottleneck x sum(layers)    features             -> features (stride 2 at each new stage)
    ClassifierHead              features             -> logits (B, num_classes)

The stem is a 7x7 stride-2 convolution, BatchNorm, ReLU and 3x3 max-pool; a
bottleneck is 1x1, 3x3 (carrying the stride, as in torchvision's "v1.5") and
1x1 convolutions with BatchNorm, plus a projection shortcut where the shape
changes. BatchNorm normalises over each micro-batch, so a pipelined step and a
whole-batch step differ unless the micro-batch is the whole batch; compare them
in ``eval()`` mode or with one micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twobp.models.common import Device, build_blocks, home_device, upcast
from twobp.models.spec import ModelSpec, stacked_kinds

EXPANSION = 4
"""A bottleneck's output has ``EXPANSION`` times its inner width."""


@dataclass(frozen=True)
class ResNetConfig:
    """Size of a bottleneck ResNet."""

    layers: tuple[int, ...] = (3, 8, 36, 3)
    """Bottlenecks per stage ((3, 8, 36, 3) is ResNet-152, (3, 4, 6, 3) ResNet-50)."""
    width: int = 64
    """Inner width of the first stage; it doubles at each later stage."""
    image_size: int = 224
    """Height and width of the example images."""
    num_classes: int = 1000
    """Number of output classes."""
    in_channels: int = 3
    """Channels of the input images."""


class Stem(nn.Module):
    """First block: 7x7/2 conv, BatchNorm, ReLU, 3x3/2 max-pool."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.conv = nn.Conv2d(config.in_channels, config.width, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(config.width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.bn(self.conv(images))), 3, stride=2, padding=1)


class Bottleneck(nn.Module):
    """``relu(shortcut(x) + bn(conv1x1(relu(bn(conv3x3(relu(bn(conv1x1(x)))))))))``."""

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class ClassifierHead(nn.Module):
    """Last block: global average pool and a linear classifier."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.mean(dim=(2, 3)))  # type: ignore[no-any-return]


def resnet_blocks(
    config: ResNetConfig,
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> list[nn.Module]:
    """The blocks of a bottleneck ResNet.

    Args:
        config: the model's size.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32).
        seed: initialisation seed (``None``: global random state).

    Returns:
        ``[Stem, Bottleneck * sum(layers), ClassifierHead]``.
    """
    shapes: list[tuple[int, int, int]] = []  # (in_channels, width, stride) per bottleneck
    channels = config.width
    for stage, count in enumerate(config.layers):
        width = config.width * 2**stage
        for i in range(count):
            shapes.append((channels, width, 2 if stage > 0 and i == 0 else 1))
            channels = width * EXPANSION
    factories: list[Callable[[], nn.Module]] = [lambda: Stem(config)]
    factories += [functools.partial(Bottleneck, *shape) for shape in shapes]
    factories.append(lambda: ClassifierHead(channels, config.num_classes))
    return build_blocks(factories, device=device, dtype=dtype, seed=seed)


def classification_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of class logits ``(B, classes)`` against labels ``(B,)``."""
    return F.cross_entropy(upcast(logits), target)


def build_resnet(
    config: ResNetConfig,
    size: str = "custom",
    *,
    device: Device = None,
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> ModelSpec:
    """A bottleneck ResNet as pipeline blocks, with random images, labels and loss.

    Args:
        config: the model's size.
        size: the preset name, for reports.
        device: where to build (``"meta"`` allocates nothing).
        dtype: parameter dtype (default float32); the example images use it too.
        seed: initialisation seed (``None``: global random state).

    Returns:
        The model spec; ``example_input`` gives images ``(B, C, H, W)``,
        ``example_target`` class labels ``(B,)``.
    """
    blocks = resnet_blocks(config, device=device, dtype=dtype, seed=seed)
    place = home_device(device)
    image_dtype = dtype or torch.float32
    shape = (config.in_channels, config.image_size, config.image_size)

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        images = torch.randn((batch_size, *shape), generator=gen, dtype=image_dtype)
        labels = torch.randint(0, config.num_classes, (batch_size,), generator=gen)
        return images.to(place), labels.to(place)

    return ModelSpec(
        family="resnet",
        size=size,
        config=config,
        blocks=blocks,
        block_kinds=stacked_kinds(sum(config.layers)),
        loss_fn=classification_loss,
        make_batch=make_batch,
        meta={"num_classes": config.num_classes, "image_size": config.image_size},
    )
