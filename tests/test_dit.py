"""DiT backbone: published parameter counts, adaLN-Zero identity at init, shapes, and bad sizes."""

import pytest
import torch

from backbones import build_backbone
from backbones.common import sincos_2d
from routing import ConfigError

# DiT paper (Table 4), 32x32x4 latents, patch 2; ours predicts no variance, so the final layer is a bit smaller.
PUBLISHED_M = {"S": 33.0, "B": 130.5, "L": 458.1, "XL": 675.1}


@pytest.mark.parametrize("preset", list(PUBLISHED_M))
def test_parameter_counts_within_one_percent_of_dit(preset):
    with torch.device("meta"):
        model = build_backbone("dit", preset, input_size=32, in_channels=4, patch_size=2, num_classes=1000)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    assert params == pytest.approx(PUBLISHED_M[preset], rel=0.01)


def test_fresh_blocks_are_identity_and_output_is_zero():
    model = build_backbone("dit", "tiny", input_size=8, in_channels=3, patch_size=2, num_classes=5)
    x, c = torch.randn(2, 16, 128), torch.randn(2, 128)
    for block in model.blocks:
        torch.testing.assert_close(block(x, c, (4, 4)), x)
    out = model(torch.randn(2, 3, 8, 8), torch.randn(2), torch.tensor([0, 5]))
    assert out.shape == (2, 3, 8, 8) and out.abs().max() == 0


def test_trained_backbone_round_trips_shape_and_uses_labels():
    torch.manual_seed(0)
    model = build_backbone("dit", "tiny", input_size=(8, 12), in_channels=2, patch_size=4, num_classes=3, depth=2)
    for p in model.parameters():  # leave adaLN-Zero's start so outputs depend on inputs
        torch.nn.init.normal_(p, std=0.05)
    x, t = torch.randn(2, 2, 8, 12), torch.randn(2)
    a = model(x, t, torch.tensor([0, 1]))
    b = model(x, t, torch.tensor([2, 1]))
    assert a.shape == x.shape
    assert not torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1])


def test_sincos_positions_are_distinct_and_fixed():
    pe = sincos_2d(64, (4, 6))
    assert pe.shape == (24, 64)
    assert torch.cdist(pe, pe).add(torch.eye(24)).min() > 0.1
    torch.testing.assert_close(pe, sincos_2d(64, (4, 6)))


def test_image_not_divisible_by_patch_is_a_config_error():
    with pytest.raises(ConfigError, match="patch_size=3"):
        build_backbone("dit", "tiny", input_size=16, in_channels=1, patch_size=3, num_classes=10)


def test_unknown_family_and_preset_name_the_key():
    with pytest.raises(ConfigError, match="backbone.name='vit'"):
        build_backbone("vit", "tiny", input_size=16, in_channels=1, patch_size=2, num_classes=10)
    with pytest.raises(ConfigError, match="backbone.preset='XXL'"):
        build_backbone("dit", "XXL", input_size=16, in_channels=1, patch_size=2, num_classes=10)
