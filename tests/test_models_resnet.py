"""Bottleneck ResNet: feature shapes through the stages, counts of known sizes."""

import torch

from twobp.models import build_model
from twobp.models.resnet import Bottleneck


def test_feature_shapes_follow_the_stages():
    spec = build_model("resnet", "tiny", dtype=torch.float64)
    x = spec.example_input(2)
    shapes = []
    for block in spec.blocks:
        x = block(x)
        shapes.append(tuple(x.shape))
    # width 8: stages of 32, 64, 128, 256 channels; 32x32 images, stem divides by 4.
    assert shapes == [
        (2, 8, 8, 8),
        (2, 32, 8, 8),
        (2, 64, 4, 4),
        (2, 128, 2, 2),
        (2, 256, 1, 1),
        (2, 10),
    ]


def test_projection_shortcut_only_where_shape_changes():
    spec = build_model("resnet", "small", device="meta")
    bottlenecks = [b for b in spec.blocks if isinstance(b, Bottleneck)]
    with_projection = [
        i for i, b in enumerate(bottlenecks) if not isinstance(b.shortcut, torch.nn.Identity)
    ]
    assert with_projection == [0, 2, 4, 6]


def test_resnet50_has_its_published_parameter_count():
    assert build_model("resnet", "50", device="meta").num_parameters() == 25_557_032


def test_resnet152_matches_torchvision_count():
    assert build_model("resnet", "152", device="meta").num_parameters() == 60_192_808
