"""Bidirectional Mamba for diffusion (Vision Mamba / DiM style) as an adaLN-Zero block of the plain stack.

Block: x += g1 * BiMamba(modulate(LN(x))); x += g2 * MLP(modulate(LN(x))).

The MLP half is kept (mlp_ratio > 0, the default) so that the three families differ only in their token
mixer: DiT has attention + MLP and Diffusion-RWKV spatial mix + channel mix, so routing comparisons
across families then compare mixers rather than block shapes. mlp_ratio=0 gives the mixer-only block of
Vision Mamba, DiS and ZigMa (3 adaLN chunks); at B size it has about half the parameters (see docs/mamba.md).

Mixer (Mamba, Gu & Dao 2023, made bidirectional as in Vision Mamba): in_proj to (x, z); for the forward
and for the reversed sequence, each with its own weights: depthwise causal conv + SiLU, x_proj -> (dt, B, C),
selective scan; the reversed direction's output is flipped back, the two are summed, gated by silu(z) and
projected out. Scan orders may change per layer (row-major, column-major and their reverses on the (h, w)
grid, DiM / ZigMa style); tokens are permuted into the order before the mixer and back after it.
`ssm="mamba2"` swaps the S6 scan for Mamba-2's scalar-decay-per-head scan (SSD) in the same mixer; on CUDA it runs
flash-linear-attention's chunk_simple_gla when fla-core is installed (backbones/ops/ssd_fla.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from backbones.common import AdaLNZero, modulate
from backbones.ops.cuda_kernels import conv_fn, scan_fn
from backbones.ops.ssd_fla import ssd_fn

# Widths and depths of DiT's S / B / L; Mamba's parameter counts differ (docs/mamba.md lists them).
PRESETS = {
    "tiny": dict(hidden_size=128, depth=8),
    "S": dict(hidden_size=384, depth=12),
    "B": dict(hidden_size=768, depth=12),
    "L": dict(hidden_size=1024, depth=24),
    # Sized after papers; `python -m train.bench.presets` prints each count beside the paper's (docs/presets.md).
    # TREAD's Mamba row (Krause et al. 2025) gives only its size, 111M: DiT-B's width at the depth that comes
    # nearest with this block (MLP kept, as in the presets above).
    "tread-111M": dict(hidden_size=768, depth=9),
    # DiS-S/B/M/L/H (Fei et al. 2024): the widths and depths of its release (models_dis.py), Vision Mamba blocks
    # without an MLP. DiS conditions through time and label tokens and adds long skips; here adaLN-Zero conditions.
    "DiS-S": dict(hidden_size=368, depth=24, mlp_ratio=0.0),
    "DiS-B": dict(hidden_size=768, depth=24, mlp_ratio=0.0),
    "DiS-M": dict(hidden_size=768, depth=48, mlp_ratio=0.0),
    "DiS-L": dict(hidden_size=1024, depth=48, mlp_ratio=0.0),
    "DiS-H": dict(hidden_size=1536, depth=48, mlp_ratio=0.0),
    # DiM-L/H (Teng et al. 2024): its ImageNet-256 configs, 49 Mamba layers without an MLP, conv width 3, the scan
    # order changing layer by layer. DiM scans one way per layer; this mixer scans both ways.
    "DiM-L": dict(hidden_size=1024, depth=49, mlp_ratio=0.0, d_conv=3, scan_order="alternate"),
    "DiM-H": dict(hidden_size=1536, depth=49, mlp_ratio=0.0, d_conv=3, scan_order="alternate"),
}

SCAN_ORDERS = ("row", "col", "row_rev", "col_rev")


def scan_permutation(grid: tuple[int, int], order: str) -> torch.Tensor:
    """Raster indices of the tokens in the order `order` visits them on the (h, w) grid: (h*w,) long.

    "row" is raster order, "col" goes down each column in turn, "*_rev" visit the same path backwards.
    """
    if order not in SCAN_ORDERS:
        raise ValueError(f"scan order must be one of {SCAN_ORDERS}, got {order!r}")
    h, w = grid
    index = torch.arange(h * w).view(h, w)  # raster index of each grid cell
    if order.startswith("col"):
        index = index.t()  # (h, w) -> (w, h): flattening now walks columns
    path = index.reshape(-1)
    return path.flip(0) if order.endswith("_rev") else path


def _dt_bias(size: int, dt_min: float, dt_max: float, dt_floor: float = 1e-4) -> torch.Tensor:
    """Mamba's dt bias: inverse softplus of dt drawn log-uniformly in [dt_min, dt_max]."""
    dt = torch.exp(torch.rand(size) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_floor)
    return dt + torch.log(-torch.expm1(-dt))  # softplus^{-1}(dt) = dt + log(1 - exp(-dt))


class _Direction(nn.Module):
    """One scan direction of the mixer: causal conv + SiLU, input-dependent (dt, B, C), selective scan.

    ssm="mamba1": S6 with A of shape (d_inner, d_state) and low-rank dt (dt_proj from dt_rank).
    ssm="mamba2": SSD with one decay per head (d_inner / headdim heads) and dt straight from x_proj.
    """

    def __init__(self, d_inner: int, d_state: int, d_conv: int, dt_rank: int, ssm: str, headdim: int,
                 dt_min: float = 1e-3, dt_max: float = 1e-1):
        super().__init__()
        self.ssm, self.d_state, self.headdim = ssm, d_state, headdim
        self.conv_weight = nn.Parameter(torch.empty(d_inner, d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(d_inner))
        # PyTorch's default bound for a depthwise conv (fan_in = d_conv), written out.
        nn.init.uniform_(self.conv_weight, -d_conv**-0.5, d_conv**-0.5)
        if ssm == "mamba1":
            self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
            self.dt_proj = nn.Linear(dt_rank, d_inner)
            # Mamba's dt init: weights keep dt_proj's output O(1), the bias sets dt in [dt_min, dt_max].
            nn.init.uniform_(self.dt_proj.weight, -dt_rank**-0.5, dt_rank**-0.5)
            with torch.no_grad():
                self.dt_proj.bias.copy_(_dt_bias(d_inner, dt_min, dt_max))
            # S4D-real init A = -(1, ..., N) for every channel, stored as log(-A).
            self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1.0)).repeat(d_inner, 1))  # (d_inner, N)
            self.D = nn.Parameter(torch.ones(d_inner))
        else:
            if d_inner % headdim:
                raise ValueError(f"d_inner={d_inner} must be divisible by headdim={headdim} for ssm='mamba2'")
            heads = d_inner // headdim
            self.x_proj = nn.Linear(d_inner, heads + 2 * d_state, bias=False)
            self.dt_bias = nn.Parameter(_dt_bias(heads, dt_min, dt_max))
            # Mamba-2's init: one decay rate per head, A = -U(1, 16).
            self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
            self.D = nn.Parameter(torch.ones(heads))
        nn.init.xavier_uniform_(self.x_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, E, L) in this direction's order -> y (B, E, L), before the z gate."""
        x = conv_fn(x, self.conv_weight, self.conv_bias, activation="silu")
        params = self.x_proj(x.transpose(1, 2))  # (B, E, L) -> (B, L, E) -> (B, L, R + 2N)
        dt, B, C = params.split([params.shape[-1] - 2 * self.d_state, self.d_state, self.d_state], dim=-1)
        A = -torch.exp(self.A_log.float())
        if self.ssm == "mamba1":
            dt = torch.einsum("er,blr->bel", self.dt_proj.weight, dt)  # dt_proj without bias: (B, L, R) -> (B, E, L)
            B, C = B.transpose(1, 2), C.transpose(1, 2)  # (B, L, N) -> (B, N, L)
            return scan_fn(x, dt.contiguous(), A, B.contiguous(), C.contiguous(), self.D.float(),
                           delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
        b, e, l = x.shape
        heads_x = x.transpose(1, 2).reshape(b, l, -1, self.headdim)  # (B, E, L) -> (B, L, H, P)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # (B, L, H)
        y = ssd_fn(heads_x, dt, A, B[:, :, None], C[:, :, None], self.D.float())  # B, C: (B, L, N) -> (B, L, 1, N)
        return y.reshape(b, l, e).transpose(1, 2)  # (B, L, H, P) -> (B, E, L)


class BiMambaMixer(nn.Module):
    """Bidirectional Mamba mixer on a token sequence (B, L, D) -> (B, L, D)."""

    def __init__(self, d_model: int, d_state: int = 16, expand: int = 2, d_conv: int = 4,
                 dt_rank: int | str = "auto", ssm: str = "mamba1", headdim: int = 64):
        super().__init__()
        if ssm not in ("mamba1", "mamba2"):
            raise ValueError(f"ssm must be 'mamba1' or 'mamba2', got {ssm!r}")
        d_inner = expand * d_model
        dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.forward_dir = _Direction(d_inner, d_state, d_conv, dt_rank, ssm, headdim)
        self.backward_dir = _Direction(d_inner, d_state, d_conv, dt_rank, ssm, headdim)
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)
        for layer in (self.in_proj, self.out_proj):
            nn.init.xavier_uniform_(layer.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, z = self.in_proj(tokens).transpose(1, 2).chunk(2, dim=1)  # (B, L, 2E) -> (B, 2E, L) -> 2 x (B, E, L)
        # Forward scan plus the scan of the reversed sequence, flipped back.
        y = self.forward_dir(x) + self.backward_dir(x.flip(-1)).flip(-1)
        y = y * F.silu(z)
        return self.out_proj(y.transpose(1, 2))  # (B, E, L) -> (B, L, E) -> (B, L, D)


class Block(nn.Module):
    """adaLN-Zero bidirectional Mamba block; needs the grid for its column-major scan orders."""

    needs_grid = True

    def __init__(self, hidden_size: int, layer_idx: int, depth: int, d_state: int = 16, expand: int = 2,
                 d_conv: int = 4, dt_rank: int | str = "auto", scan_order: str = "row", mlp_ratio: float = 4.0,
                 ssm: str = "mamba1", headdim: int = 64):
        super().__init__()
        if scan_order not in ("row", "alternate"):
            raise ValueError(f"scan_order must be 'row' or 'alternate', got {scan_order!r}")
        # "alternate" cycles row, col, row_rev, col_rev over layers (DiM / ZigMa). The mixer already scans
        # both ways, so a reversed order only swaps which direction's weights see which way.
        self.order = SCAN_ORDERS[layer_idx % len(SCAN_ORDERS)] if scan_order == "alternate" else "row"
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mixer = BiMambaMixer(hidden_size, d_state, expand, d_conv, dt_rank, ssm, headdim)
        self.mlp = None
        if mlp_ratio > 0:
            self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
            self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
            for layer in (self.mlp.fc1, self.mlp.fc2):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)
        self.adaLN = AdaLNZero(hidden_size, 6 if self.mlp is not None else 3)

    def _mix(self, x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        """The mixer in this layer's scan order; grid=None falls back to raster (1-D) order."""
        # Without a grid (an unstructured token subset) there are no columns: every layer scans the tokens
        # in their given order. This is the opt-in 1-D ablation; the router rejects it otherwise.
        if grid is None or self.order == "row":
            return self.mixer(x)
        if grid[0] * grid[1] != x.shape[1]:
            raise ValueError(f"grid {grid} does not match {x.shape[1]} tokens")
        path = scan_permutation(grid, self.order).to(x.device)
        # Tokens into scan order, mixed, and back: argsort(path) is the inverse permutation.
        return self.mixer(x[:, path])[:, torch.argsort(path)]

    def forward(self, x: torch.Tensor, c: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        if self.mlp is None:
            shift1, scale1, g1 = self.adaLN(c)
            return x + g1[:, None] * self._mix(modulate(self.norm1(x), shift1, scale1), grid)
        shift1, scale1, g1, shift2, scale2, g2 = self.adaLN(c)
        x = x + g1[:, None] * self._mix(modulate(self.norm1(x), shift1, scale1), grid)
        return x + g2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))
