"""Diffusion-RWKV (Fei et al. 2024) blocks for the plain stack: Vision-RWKV's spatial mix (Q-shift + Bi-WKV)
and channel mix, each under adaLN-Zero modulation and gating.

    x = x + g1 * SpatialMix(modulate(LN(x), shift1, scale1))
    x = x + g2 * ChannelMix(modulate(LN(x), shift2, scale2))

Initialisation follows Vision-RWKV (Duan et al. 2024): decays spread over channels and deepening with the
layer, token-shift mixes that move from "mostly shifted" to "mostly own token" across channels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from backbones.common import AdaLNZero, modulate
from backbones.ops.wkv import bi_wkv

# Widths and depths as DiT's S/B/L (the TREAD paper used the DiT configuration for its RWKV model too).
# A block has 19 D^2 weights (DiT's has 18 D^2), so each preset is about 5% larger than its DiT twin.
PRESETS = {
    "tiny": dict(hidden_size=128, depth=8, mlp_ratio=4.0),
    "S": dict(hidden_size=384, depth=12, mlp_ratio=4.0),
    "B": dict(hidden_size=768, depth=12, mlp_ratio=4.0),
    "L": dict(hidden_size=1024, depth=24, mlp_ratio=4.0),
    # Sized after papers; `python -m train.bench.presets` prints each count beside the paper's (docs/presets.md).
    # TREAD's RWKV row (Krause et al. 2025) gives only its size, 210M: DiT-B's width at the depth that comes
    # nearest in this block.
    "tread-210M": dict(hidden_size=768, depth=18, mlp_ratio=4.0),
    # Diffusion-RWKV's DRWKV-S/B/M/L/H: the widths and depths of its release (models_drwkv.py). Its long skips
    # between shallow and deep layers are not built here, so these hold fewer parameters than the originals.
    "DRWKV-S": dict(hidden_size=384, depth=13, mlp_ratio=4.0),
    "DRWKV-B": dict(hidden_size=384, depth=25, mlp_ratio=4.0),
    "DRWKV-M": dict(hidden_size=512, depth=25, mlp_ratio=4.0),
    "DRWKV-L": dict(hidden_size=768, depth=37, mlp_ratio=4.0),
    "DRWKV-H": dict(hidden_size=1024, depth=37, mlp_ratio=4.0),
}


def q_shift(x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
    """Vision-RWKV's Q-shift: each channel quarter takes one neighbour on the (h, w) grid, zero at borders.

    x: (B, N, D) tokens in raster order, N = h w, D divisible by 4. Quarters 1-4 take the left, right,
    upper and lower neighbour. With grid None (an unstructured token subset; 1-D ablation only) it
    degenerates to a 1-D shift along the sequence: the first half of the channels takes the previous
    token, the second half the next one.
    """
    B, N, D = x.shape
    if grid is None:
        prev, nxt = x.chunk(2, dim=-1)
        prev = F.pad(prev, (0, 0, 1, 0))[:, :-1]  # token i gets token i - 1
        nxt = F.pad(nxt, (0, 0, 0, 1))[:, 1:]  # token i gets token i + 1
        return torch.cat([prev, nxt], dim=-1)
    h, w = grid
    x = x.reshape(B, h, w, D)  # (B, N, D) -> (B, h, w, D)
    left, right, up, down = x.chunk(4, dim=-1)
    # F.pad pads the last dims first: (D, D, w, w, h, h).
    left = F.pad(left, (0, 0, 1, 0))[:, :, :-1]  # (i, j) gets (i, j - 1)
    right = F.pad(right, (0, 0, 0, 1))[:, :, 1:]  # (i, j) gets (i, j + 1)
    up = F.pad(up, (0, 0, 0, 0, 1, 0))[:, :-1]  # (i, j) gets (i - 1, j)
    down = F.pad(down, (0, 0, 0, 0, 0, 1))[:, 1:]  # (i, j) gets (i + 1, j)
    return torch.cat([left, right, up, down], dim=-1).view(B, N, D)  # (B, h, w, D) -> (B, N, D)


def _channel_ramp(dim: int, power: float) -> torch.Tensor:
    """(i / dim) ** power over channels i: Vision-RWKV's token-shift mix init (0 = fully shifted)."""
    return (torch.arange(dim, dtype=torch.float32) / dim) ** power


def _mix(shifted: torch.Tensor, x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Token-shift mix x mu + shifted (1 - mu), in the tokens' dtype.

    torch.lerp needs one dtype for all three and autocast does not cover it: an fp32 mu on bf16 tokens (a bf16
    residual stream, or a LayerNorm that autocast leaves in bf16, as on the CPU) would fail. mu is cast as
    autocast casts a Linear's weight; its gradient still reaches the fp32 parameter.
    """
    return torch.lerp(shifted, x, mu.to(x.dtype))


class SpatialMix(nn.Module):
    """Token mixing: y = W_o(sigmoid(r) * LN(BiWKV(w / T, u / T, k, v))) on Q-shift-mixed k, v, r."""

    def __init__(self, dim: int, layer_idx: int, depth: int):
        super().__init__()
        deeper = layer_idx / max(depth - 1, 1)  # 0 at the first layer, 1 at the last
        shallower = 1.0 - layer_idx / depth  # 1 at the first layer, towards 0 at the last
        self.mu_k = nn.Parameter(_channel_ramp(dim, shallower))
        self.mu_v = nn.Parameter(_channel_ramp(dim, shallower) + 0.3 * deeper)
        self.mu_r = nn.Parameter(_channel_ramp(dim, 0.5 * shallower))
        # Decay w T from -5 (growing with distance) to 3 (fast decay) across channels, so channels
        # cover every receptive-field width; deeper layers skew towards slower decays.
        channel = torch.arange(dim, dtype=torch.float32) / max(dim - 1, 1)
        self.spatial_decay = nn.Parameter(-5 + 8 * channel ** (0.7 + 1.3 * deeper))
        zigzag = 0.5 * (((torch.arange(dim) + 1) % 3) - 1).float()
        self.spatial_first = nn.Parameter(math.log(0.3) + zigzag)
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim, bias=False)
        self.receptance = nn.Linear(dim, dim, bias=False)
        # Vision-RWKV normalises the WKV output before the gate: the weighted average over T tokens
        # changes scale with T and with the decays, and the norm keeps it stable at large T.
        self.key_norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        # T is the number of tokens this block is given (the subset on a routed layer): decay and bonus
        # are per-sequence quantities that Vision-RWKV divides by the current length, which is what
        # lets one model run at any resolution; a routed subset is simply a shorter sequence.
        T = x.shape[1]
        shifted = q_shift(x, grid)
        k = self.key(_mix(shifted, x, self.mu_k))
        v = self.value(_mix(shifted, x, self.mu_v))
        r = self.receptance(_mix(shifted, x, self.mu_r))
        wkv = bi_wkv(self.spatial_decay / T, self.spatial_first / T, k, v)
        return self.output(torch.sigmoid(r) * self.key_norm(wkv))


class ChannelMix(nn.Module):
    """Per-token MLP: y = sigmoid(W_r xr) * W_v(relu(W_k xk)^2) on Q-shift-mixed xk, xr."""

    def __init__(self, dim: int, hidden: int, layer_idx: int, depth: int):
        super().__init__()
        shallower = 1.0 - layer_idx / depth
        self.mu_k = nn.Parameter(_channel_ramp(dim, shallower))
        self.mu_r = nn.Parameter(_channel_ramp(dim, shallower))
        self.key = nn.Linear(dim, hidden, bias=False)
        self.value = nn.Linear(hidden, dim, bias=False)
        self.receptance = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        shifted = q_shift(x, grid)
        k = torch.relu(self.key(_mix(shifted, x, self.mu_k))).square()
        return torch.sigmoid(self.receptance(_mix(shifted, x, self.mu_r))) * self.value(k)


class Block(nn.Module):
    """x += g1 * SpatialMix(modulate(LN(x))); x += g2 * ChannelMix(modulate(LN(x))). Needs the token grid."""

    needs_grid = True

    def __init__(self, hidden_size: int, layer_idx: int, depth: int, mlp_ratio: float = 4.0):
        super().__init__()
        if hidden_size % 4:
            raise ValueError(f"RWKV hidden_size={hidden_size} must be divisible by 4 (Q-shift uses channel quarters).")
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.spatial_mix = SpatialMix(hidden_size, layer_idx, depth)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.channel_mix = ChannelMix(hidden_size, int(hidden_size * mlp_ratio), layer_idx, depth)
        self.adaLN = AdaLNZero(hidden_size, 6)
        for module in (self.spatial_mix, self.channel_mix):
            for layer in module.modules():
                if isinstance(layer, nn.Linear):
                    nn.init.xavier_uniform_(layer.weight)

    def forward(self, x: torch.Tensor, c: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        if grid is not None and grid[0] * grid[1] != x.shape[1]:
            raise ValueError(f"grid {tuple(grid)} does not hold the {x.shape[1]} tokens given to the RWKV block.")
        shift1, scale1, g1, shift2, scale2, g2 = self.adaLN(c)
        x = x + g1[:, None] * self.spatial_mix(modulate(self.norm1(x), shift1, scale1), grid)
        return x + g2[:, None] * self.channel_mix(modulate(self.norm2(x), shift2, scale2), grid)
