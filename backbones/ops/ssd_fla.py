"""Mamba-2's scan (SSD) on flash-linear-attention's chunked kernels on CUDA, our PyTorch SSD elsewhere.

SSD (backbones/ops/ssd.py) has one scalar decay per head and step, which is simple gated linear attention (simple
GLA). flash-linear-attention's `chunk_simple_gla` (package fla-core, the `cuda` extra) computes it with chunked
tensor-core matmuls in Triton; per head, with S of shape (K, V):

    S_t = exp(g_t) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t          (q, k: [B, T, H, K]; v: [B, T, H, V];
                                                                        g: [B, T, H], the natural-log decay)
Our SSD per head, H_t of shape (p, n):  H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T,  y_t = H_t C_t + D x_t.
So S = H^T with K = n (state) and V = p (head dim): q = C, k = B (each head reading its group), v = dt x,
g = dt A, scale = 1; D x is added outside. No initial state and no final state are needed. (Facts read from
fla-core 0.6.0's fla/ops/simple_gla/chunk.py: the [B, T, H, ...] layout, g as a per-head log decay that the kernel
rescales to log2 itself, `scale` defaulting to K^-0.5 unless given.)

`ssd_fn` picks: fla's kernel for CUDA tensors when fla imports, else our chunked PyTorch SSD (the CPU path and the
GPU tests' ground truth). TREAD_SSD_BACKEND=torch forces ours, =fla requires fla. fla's kernel is a
`torch.compiler.disable` function, so under torch.compile it is a graph break.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from backbones.ops.ssd import ssd_scan

log = logging.getLogger(__name__)

SSD_BACKENDS = ("auto", "fla", "torch")


@functools.cache
def fla_chunk_simple_gla() -> Callable | None:
    """fla's chunk_simple_gla, or None when fla-core cannot be imported (it needs Triton and a GPU to run)."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as err:  # noqa: BLE001 - any failure means "use ours"
        log.info("flash-linear-attention unavailable (%s: %s)", type(err).__name__, err)
        return None
    return chunk_simple_gla


def gla_arguments(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> dict:
    """SSD's tensors as chunk_simple_gla's arguments (q, k, v, g, scale), in x's dtype except g (fp32 or fp64).

    x: (b, l, h, p); dt: (b, l, h); A: (h,); B, C: (b, l, g, n), head i reading group i // (h // g).
    """
    heads_per_group = x.shape[2] // B.shape[2]
    q, k = (t.to(x.dtype).repeat_interleave(heads_per_group, dim=2) for t in (C, B))  # (b, l, g, n) -> (b, l, h, n)
    v = x * dt.to(x.dtype)[..., None]  # dt_t x_t: (b, l, h, p)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    g = dt.to(wide) * A.to(wide)  # log decay per head and step, <= 0: (b, l, h)
    return dict(q=q, k=k, v=v, g=g, scale=1.0)


def ssd_fla(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
            D: torch.Tensor | None = None, kernel: Callable | None = None) -> torch.Tensor:
    """ssd_scan's semantics through a simple-GLA kernel (fla's chunk_simple_gla unless `kernel` is given);
    returns x's dtype."""
    if x.shape[2] % B.shape[2]:
        raise ValueError(f"heads h={x.shape[2]} are not divisible by the {B.shape[2]} groups of B and C")
    kernel = kernel or fla_chunk_simple_gla()
    if kernel is None:
        raise RuntimeError("the fla SSD path needs flash-linear-attention: pip install -e '.[cuda]'")
    y, _ = kernel(**gla_arguments(x, dt, A, B, C))
    y = y.to(torch.promote_types(y.dtype, torch.float32))
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * x.to(y.dtype)  # (h,) -> (h, 1) against (b, l, h, p)
    return y.to(x.dtype)


def ssd_backend(on_cuda: bool) -> str:
    """"fla" or "torch": TREAD_SSD_BACKEND (default "auto": fla on CUDA when it imports)."""
    backend = os.environ.get("TREAD_SSD_BACKEND", "auto")
    if backend not in SSD_BACKENDS:
        raise ValueError(f"TREAD_SSD_BACKEND must be one of {SSD_BACKENDS}, got {backend!r}")
    if backend == "torch" or not on_cuda:
        if backend == "fla":
            raise RuntimeError("TREAD_SSD_BACKEND=fla needs CUDA tensors; on a CPU use 'torch'")
        return "torch"
    if fla_chunk_simple_gla() is None:
        if backend == "fla":
            raise RuntimeError("TREAD_SSD_BACKEND=fla needs flash-linear-attention: pip install -e '.[cuda]'")
        return "torch"
    return "fla"


def ssd_fn(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: torch.Tensor | None = None) -> torch.Tensor:
    """ssd_scan's semantics (backbones/ops/ssd.py) on the path `ssd_backend` picks."""
    if ssd_backend(x.is_cuda) == "fla":
        return ssd_fla(x, dt, A, B, C, D)
    return ssd_scan(x, dt, A, B, C, D)
