"""Depthwise causal 1-D convolution (the short conv in front of Mamba's scan), in pure PyTorch.

Same semantics as causal-conv1d's `causal_conv1d_fn`: out_t = sum_i weight[:, i] * x_{t - (k - 1) + i},
with x zero before the start, so the output at t never sees inputs after t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """x (b, d, l), weight (d, k), bias (d,); activation None or "silu" ("swish" is the same)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    d, k = weight.shape
    # Left padding by k - 1 makes the cross-correlation causal.
    out = F.conv1d(F.pad(x, (k - 1, 0)), weight[:, None, :], bias, groups=d)  # weight (d, k) -> (d, 1, k)
    return F.silu(out) if activation is not None else out
