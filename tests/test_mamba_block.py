"""The bidirectional Mamba block: scan orders on the grid, adaLN-Zero identity, gradients, 1-D fallback."""

from __future__ import annotations

import pytest
import torch

from backbones import build_backbone
from backbones.mamba import PRESETS, SCAN_ORDERS, Block, scan_permutation

GRID = (3, 4)


def test_column_major_visits_the_grid_column_by_column():
    h, w = GRID
    path = scan_permutation(GRID, "col")
    rows, cols = path // w, path % w
    # Consecutive runs of h tokens share one column, columns come left to right, rows top to bottom.
    assert torch.equal(cols.view(w, h), torch.arange(w)[:, None].expand(w, h))
    assert torch.equal(rows.view(w, h), torch.arange(h)[None].expand(w, h))
    assert torch.equal(scan_permutation(GRID, "row"), torch.arange(h * w))


@pytest.mark.parametrize("order", ["row", "col"])
def test_reversed_orders_reverse_the_path(order):
    assert torch.equal(scan_permutation(GRID, f"{order}_rev"), scan_permutation(GRID, order).flip(0))


@pytest.mark.parametrize("order", SCAN_ORDERS)
def test_permutation_then_inverse_is_identity(order):
    path = scan_permutation(GRID, order)
    assert torch.equal(path.sort().values, torch.arange(GRID[0] * GRID[1]))
    x = torch.randn(2, 12, 5)
    torch.testing.assert_close(x[:, path][:, torch.argsort(path)], x)


def _perturbed(block: Block) -> Block:
    """Random adaLN weights, so that the gates are open and every parameter gets a gradient."""
    with torch.no_grad():
        for p in block.adaLN.parameters():
            p.normal_(std=0.5)
    return block


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(scan_order="alternate"), dict(mlp_ratio=0), dict(ssm="mamba2", headdim=16)]
)
def test_fresh_block_is_identity(kwargs):
    torch.manual_seed(0)
    block = Block(32, 1, 4, **kwargs)
    x, c = torch.randn(2, 12, 32), torch.randn(2, 32)
    torch.testing.assert_close(block(x, c, GRID), x, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [dict(scan_order="alternate"), dict(mlp_ratio=0), dict(ssm="mamba2", headdim=16)])
def test_gradients_reach_every_parameter(kwargs):
    torch.manual_seed(0)
    block = _perturbed(Block(32, 1, 4, **kwargs))
    x, c = torch.randn(2, 12, 32, requires_grad=True), torch.randn(2, 32)
    block(x, c, GRID).square().sum().backward()
    missing = [name for name, p in block.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing
    assert x.grad.abs().sum() > 0


def test_column_major_layer_scans_the_transposed_grid():
    """A "col" layer equals the mixer run on the grid's transpose, transposed back."""
    torch.manual_seed(0)
    block = _perturbed(Block(32, 1, 4, scan_order="alternate", mlp_ratio=0))
    assert block.order == "col"
    h, w = GRID
    x = torch.randn(2, h * w, 32)
    transposed = x.view(2, h, w, 32).transpose(1, 2).reshape(2, h * w, 32)  # (B, N, D) -> (B, w, h, D) -> (B, N, D)
    expected = block.mixer(transposed).view(2, w, h, 32).transpose(1, 2).reshape(2, h * w, 32)  # back to raster
    torch.testing.assert_close(block._mix(x, GRID), expected)
    assert not torch.allclose(block._mix(x, GRID), block.mixer(x), atol=1e-4)


def test_grid_none_falls_back_to_raster_order():
    torch.manual_seed(0)
    block = _perturbed(Block(32, 1, 4, scan_order="alternate"))
    x, c = torch.randn(2, 7, 32), torch.randn(2, 32)  # 7 tokens: an unstructured subset, no grid
    out = block(x, c, None)
    assert out.shape == x.shape and torch.isfinite(out).all()
    torch.testing.assert_close(block._mix(x, None), block.mixer(x))


def test_tiny_backbone_runs_and_starts_at_zero():
    assert {"tiny", "S", "B", "L"} <= set(PRESETS)
    model = build_backbone("mamba", "tiny", input_size=8, in_channels=4, patch_size=2, num_classes=10, depth=2)
    x = torch.randn(2, 4, 8, 8)
    out = model(x, torch.zeros(2), torch.tensor([1, 2]))
    assert out.shape == x.shape
    assert out.abs().max() == 0  # zero-initialised final layer


def test_paper_sized_presets_and_their_counts_beside_the_papers(capsys, monkeypatch):
    from train.bench import presets

    total, _ = presets.count_parameters("mamba", "tread-111M")
    assert abs(total / 111e6 - 1) < 0.05  # TREAD's Mamba row: 111M parameters
    # DiS and DiM as released: Mamba blocks without an MLP at their widths and depths.
    assert all(PRESETS[f"DiS-{s}"]["mlp_ratio"] == 0 for s in "SBMLH")
    assert (PRESETS["DiM-H"]["hidden_size"], PRESETS["DiM-H"]["depth"], PRESETS["DiM-H"]["d_conv"]) == (1536, 49, 3)
    # The command's table, on the rows that build fast (every row builds on the meta device the same way).
    shown = [r for r in presets.REFERENCES if r.preset in ("tread-111M", "DiS-S", "DRWKV-S")]
    monkeypatch.setattr(presets, "REFERENCES", shown)
    presets.main([])
    table = capsys.readouterr().out
    assert f"{total / 1e6:.1f}M | " in table and f"{total / 111e6 - 1:+.1%}" in table
    assert all(f"`{r.preset}`" in table for r in shown) and "not at hand" in table
