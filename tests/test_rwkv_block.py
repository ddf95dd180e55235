"""Diffusion-RWKV block: Q-shift neighbours, the 1-D fallback, identity at init, grid dependence, gradients."""

from __future__ import annotations

import pytest
import torch

from backbones.rwkv import PRESETS, Block, q_shift


def test_q_shift_takes_left_right_upper_lower_neighbours():
    h, w, D = 3, 4, 8
    x = torch.randn(2, h * w, D)
    out = q_shift(x, (h, w)).view(2, h, w, D)  # (B, N, D) -> (B, h, w, D)
    grid = x.view(2, h, w, D)  # (B, N, D) -> (B, h, w, D)
    q = D // 4
    for i in range(h):
        for j in range(w):
            expected = torch.zeros(2, D)
            if j > 0:
                expected[:, :q] = grid[:, i, j - 1, :q]
            if j < w - 1:
                expected[:, q : 2 * q] = grid[:, i, j + 1, q : 2 * q]
            if i > 0:
                expected[:, 2 * q : 3 * q] = grid[:, i - 1, j, 2 * q : 3 * q]
            if i < h - 1:
                expected[:, 3 * q :] = grid[:, i + 1, j, 3 * q :]
            assert torch.equal(out[:, i, j], expected), (i, j)


def test_q_shift_without_grid_shifts_along_the_sequence():
    x = torch.randn(2, 5, 6)
    out = q_shift(x, None)
    assert torch.equal(out[:, 1:, :3], x[:, :-1, :3])  # first half: previous token
    assert torch.equal(out[:, :-1, 3:], x[:, 1:, 3:])  # second half: next token
    assert torch.equal(out[:, 0, :3], torch.zeros(2, 3))
    assert torch.equal(out[:, -1, 3:], torch.zeros(2, 3))


def _perturbed_block(D: int = 32) -> Block:
    torch.manual_seed(0)
    block = Block(D, layer_idx=1, depth=4)
    # Wake adaLN-Zero up so both branches contribute.
    torch.nn.init.normal_(block.adaLN.proj[1].weight, std=0.1)
    torch.nn.init.normal_(block.adaLN.proj[1].bias, std=0.1)
    return block


def test_fresh_block_is_identity():
    block = Block(32, layer_idx=0, depth=4)
    x, c = torch.randn(2, 12, 32), torch.randn(2, 32)
    assert torch.equal(block(x, c, (3, 4)), x)
    assert torch.equal(block(x, c, None), x)


def test_output_depends_on_the_grid():
    block = _perturbed_block()
    x, c = torch.randn(2, 16, 32), torch.randn(2, 32)
    wide, square = block(x, c, (2, 8)), block(x, c, (4, 4))
    assert torch.isfinite(wide).all()
    assert not torch.allclose(wide, x, atol=1e-4)
    assert not torch.allclose(wide, square, atol=1e-4)
    assert torch.equal(block(x, c, (4, 4)), square)


def test_gradients_reach_every_parameter():
    block = _perturbed_block()
    x = torch.randn(2, 12, 32, requires_grad=True)
    c = torch.randn(2, 32, requires_grad=True)
    block(x, c, (3, 4)).square().sum().backward()
    for name, p in [("x", x), ("c", c), *block.named_parameters()]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_block_rejects_a_grid_that_does_not_hold_the_tokens():
    block = Block(32, layer_idx=0, depth=4)
    with pytest.raises(ValueError, match="grid"):
        block(torch.randn(1, 12, 32), torch.randn(1, 32), (4, 4))


def test_presets():
    assert {"tiny", "S", "B", "L"} <= PRESETS.keys()
    assert PRESETS["S"]["hidden_size"] == 384 and PRESETS["S"]["depth"] == 12
    assert PRESETS["L"]["hidden_size"] == 1024 and PRESETS["L"]["depth"] == 24


def test_block_takes_a_bf16_stream_under_autocast():
    # A bf16 residual stream (a bf16 model, or a LayerNorm that CPU autocast leaves in bf16) meets fp32 token-shift
    # mixes mu; the mix runs in the stream's dtype and the fp32 parameters still get their gradients.
    block = _perturbed_block()
    x = torch.randn(2, 12, 32).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x, torch.randn(2, 32), (3, 4))
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    for name, p in block.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_paper_sized_presets():
    from train.bench.presets import count_parameters

    # TREAD reports its RWKV at 210M parameters; the preset lands within 5% (256 tokens, 1000 classes).
    total, _ = count_parameters("rwkv", "tread-210M")
    assert abs(total / 210e6 - 1) < 0.05
    # Diffusion-RWKV's released widths and depths (models_drwkv.py), named as in its paper.
    released = {"S": (384, 13), "B": (384, 25), "M": (512, 25), "L": (768, 37), "H": (1024, 37)}
    for size, (width, depth) in released.items():
        assert (PRESETS[f"DRWKV-{size}"]["hidden_size"], PRESETS[f"DRWKV-{size}"]["depth"]) == (width, depth)
