"""The skeleton every family shares: patchify, positions, embedders, adaLN-Zero, final layer, unpatchify.

A family only supplies its block class; `Backbone` runs the stack through the shared `Router`, so
token routing plugs in at one place for DiT, RWKV and Mamba alike. SPRINT routes add one learned part, the
fusion of the sparse-deep and dense-shallow paths (`SparseDenseFusion`), which the skeleton owns.
"""

from __future__ import annotations

import math

import torch
from timm.layers import PatchEmbed
from torch import nn

from routing.errors import ConfigError
from routing.router import Router


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation; x (B, N, D), shift/scale (B, D)."""
    return x * (1 + scale[:, None]) + shift[:, None]


class AdaLNZero(nn.Module):
    """Regresses n_chunks modulation vectors from c; zero-initialised so every block starts as identity."""

    def __init__(self, hidden_size: int, n_chunks: int):
        super().__init__()
        self.n_chunks = n_chunks
        self.proj = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, n_chunks * hidden_size))
        nn.init.zeros_(self.proj[1].weight)
        nn.init.zeros_(self.proj[1].bias)

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.proj(c).chunk(self.n_chunks, dim=-1)


def sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    """Fixed sin-cos embedding of positions: (M,) -> (M, dim)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    angles = pos.double()[:, None] * omega[None]  # (M, dim/2)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


def sincos_2d(dim: int, grid: tuple[int, int]) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding in raster order: (h*w, dim); half the channels encode the row."""
    h, w = grid
    rows = torch.arange(h).repeat_interleave(w)  # (h*w,)
    cols = torch.arange(w).repeat(h)  # (h*w,)
    return torch.cat([sincos_1d(dim // 2, rows), sincos_1d(dim // 2, cols)], dim=1)


class TimestepEmbedder(nn.Module):
    """Embeds the scalar noise level c_noise with sinusoids and an MLP."""

    def __init__(self, hidden_size: int, freq_dim: int = 256, scale: float = 1000.0):
        super().__init__()
        self.freq_dim = freq_dim
        # EDM's c_noise = ln(sigma)/4 spans only about [-1.5, 1.1]; scaling it to DiT's [0, 1000] timestep
        # range lets the high-frequency sinusoids resolve nearby noise levels.
        self.scale = scale
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    def forward(self, c_noise: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=c_noise.device) / half)
        angles = (c_noise.float() * self.scale)[:, None] * freqs[None]  # (B, half)
        return self.mlp(torch.cat([angles.cos(), angles.sin()], dim=-1))


class LabelEmbedder(nn.Module):
    """Class embedding table with one extra "null" class (index num_classes) for classifier-free guidance."""

    def __init__(self, num_classes: int, hidden_size: int):
        super().__init__()
        self.num_classes = num_classes
        self.table = nn.Embedding(num_classes + 1, hidden_size)
        nn.init.normal_(self.table.weight, std=0.02)

    def forward(self, labels: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
        if labels is None:
            labels = torch.full((batch,), self.num_classes, device=device, dtype=torch.long)
        return self.table(labels)


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm + linear to patch pixels; zero-initialised so F_x starts at 0."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.adaLN = AdaLNZero(hidden_size, 2)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN(c)
        return self.linear(modulate(self.norm(x), shift, scale))


class SparseDenseFusion(nn.Module):
    """SPRINT's fusion at the end of a sparse route: Linear(2D -> D) over concat(deep path, shallow path).

    The mask token fills the positions that bypassed the route. It is a fixed random vector, not trained
    (SPRINT's release draws it N(0, 0.02^2) and freezes it), kept as a buffer so checkpoints carry it.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.register_buffer("mask_token", torch.randn(1, 1, hidden_size) * 0.02)  # (1, 1, D)
        self.proj = nn.Linear(2 * hidden_size, hidden_size)
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, deep: torch.Tensor, shallow: torch.Tensor) -> torch.Tensor:
        # The output rejoins the residual stream, so it keeps the stream's dtype: under autocast the Linear returns
        # bf16, which would carry the decoder's residual sums in bf16 (and break RWKV's fp32 token-shift mixes).
        fused = self.proj(torch.cat([deep, shallow], dim=-1))  # 2 x (B, N, D) -> (B, N, 2D) -> (B, N, D)
        return fused.to(shallow.dtype)


class Backbone(nn.Module):
    """F(x, c_noise, class_labels) for any block family: patchify -> blocks (via the router) -> unpatchify."""

    def __init__(
        self,
        block_cls: type[nn.Module],
        *,
        input_size: int | tuple[int, int],
        in_channels: int,
        patch_size: int,
        hidden_size: int,
        depth: int,
        num_classes: int,
        family: str = "",
        **block_kwargs,
    ):
        super().__init__()
        height, width = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
        if height % patch_size or width % patch_size:
            raise ConfigError(
                f"image size {height}x{width} is not divisible by backbone.patch_size={patch_size}; "
                "choose a patch size that divides the image (or latent) size."
            )
        self.family, self.block_cls = family, block_cls
        self.in_channels, self.patch_size, self.num_classes = in_channels, patch_size, num_classes
        self.grid = (height // patch_size, width // patch_size)
        self.x_embedder = PatchEmbed((height, width), patch_size, in_channels, hidden_size, bias=True)
        self.register_buffer("pos_embed", sincos_2d(hidden_size, self.grid)[None], persistent=False)  # (1, N, D)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size)
        self.blocks = nn.ModuleList(block_cls(hidden_size, i, depth, **block_kwargs) for i in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, in_channels)
        self.hidden_size = hidden_size
        self.router = Router()
        self.fusions = nn.ModuleDict()  # SPRINT routes' fusion layers, by str(start_layer_idx); see attach_router
        # Patch embedding initialised like a linear layer (DiT does the same).
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def attach_router(self, router: Router) -> None:
        """Route through `router`, with a fusion layer for each of its SPRINT routes (TREAD routes add nothing,
        so their models keep the parameters, state-dict keys and outputs they always had)."""
        self.router = router
        router.tokens = self.grid[0] * self.grid[1]  # lets router.set_draws draw before the forward (outside a compiled graph)
        self.fusions = nn.ModuleDict({str(r.start_layer_idx): SparseDenseFusion(self.hidden_size)
                                      for r in router.routes if r.mode == "sprint"})

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        b = x.shape[0]
        tokens = self.x_embedder(x) + self.pos_embed  # (B, C, H, W) -> (B, N, D)
        c = self.t_embedder(c_noise) + self.y_embedder(class_labels, b, x.device)  # (B, D)
        tokens = self.router.run(self.blocks, tokens, c, self.grid, self.training, fusions=self.fusions)
        return self.unpatchify(self.final_layer(tokens, c))

    def route_masks(self) -> list[torch.Tensor]:
        """Processed-token masks of the last forward, one (B, h, w) bool per route (empty when unrouted)."""
        return [m.view(-1, *self.grid) for m in self.router.last_masks]  # (B, N) -> (B, h, w)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        h, w = self.grid
        p, ch = self.patch_size, self.in_channels
        x = x.view(x.shape[0], h, w, p, p, ch)  # (B, N, p*p*C) -> (B, h, w, p, p, C)
        x = torch.einsum("bhwpqc->bchpwq", x)
        return x.reshape(x.shape[0], ch, h * p, w * p)  # (B, C, h, p, w, p) -> (B, C, H, W)
