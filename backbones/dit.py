"""DiT (Peebles & Xie 2023): adaLN-Zero transformer blocks; attention and MLP come from timm."""

from __future__ import annotations

import torch
from timm.layers import Mlp
from timm.models.vision_transformer import Attention
from torch import nn

from backbones.common import AdaLNZero, modulate

# DiT's configurations (Table 1 of the DiT paper); "tiny"/"small-cpu" train in minutes on a CPU.
PRESETS = {
    "tiny": dict(hidden_size=128, depth=8, num_heads=4),
    "S": dict(hidden_size=384, depth=12, num_heads=6),
    "B": dict(hidden_size=768, depth=12, num_heads=12),
    "L": dict(hidden_size=1024, depth=24, num_heads=16),
    "XL": dict(hidden_size=1152, depth=28, num_heads=16),
}


class Block(nn.Module):
    """x += g1 * Attn(modulate(LN(x))); x += g2 * MLP(modulate(LN(x))). Attention needs no grid."""

    needs_grid = False

    def __init__(self, hidden_size: int, layer_idx: int, depth: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads=num_heads, qkv_bias=True)  # SDPA inside
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN = AdaLNZero(hidden_size, 6)
        for module in (self.attn, self.mlp):
            for layer in module.modules():
                if isinstance(layer, nn.Linear):
                    nn.init.xavier_uniform_(layer.weight)
                    nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        shift1, scale1, g1, shift2, scale2, g2 = self.adaLN(c)
        x = x + g1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1))
        return x + g2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))
