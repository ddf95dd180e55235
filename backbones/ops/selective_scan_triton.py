"""Selective scan (Mamba's S6 recurrence) as fused, autotuned Triton kernels, forward and backward.

Same signature and semantics as `backbones.ops.selective_scan.selective_scan` (mamba-ssm's
`selective_scan_fn` for real A and input-dependent B, C):

    delta <- softplus(delta + delta_bias)                         (each step optional)
    h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t,   h_{-1} = 0
    y_t = C_t h_t + D u_t,   out = y * silu(z)                    (D, z optional)

u, delta, z: (b, d, l); A: (d, n); B, C: (b, n, l) or grouped (b, g, n, l), channel c using group
c // (d // g); D, delta_bias: (d,). `backbones/ops/cuda_kernels.py` decides which implementation runs.

Why this layout (mamba-ssm's, DESIGN.md section 7). At the reference shape b64 d768 l256 n16 the op is
201M state updates but only ~0.2 GB of (b, d, l) inputs and outputs per pass, so a kernel that keeps h
on-chip is bound by those bytes, and one that holds (channels, n, steps) tiles (the previous kernel) is
bound by registers instead: six live 3-D tiles left room for 16-step chunks, 16 sequential chunk
carries and a 3-D scan per step. Here a program owns (batch, BLOCK_D channels), loads its
(BLOCK_D, CHUNK) tiles of u, delta, z once, and loops over the n states one at a time; for each it
scans the (BLOCK_D, CHUNK) pairs (2^(delta A log2 e), delta B u) along time, adds C_t h_t into the
output tile and keeps only the state's last value (a (BLOCK_D, n) carry tile) for the next chunk. The
live data is (channels, steps), so CHUNK can be 256 (one chunk for 256 tokens, four for 1024) and B_t,
C_t are one contiguous row per state. A is scaled by log2(e) once per state so the inner loop uses exp2.

Counted at the reference shape, fp32, D and delta_bias, no z (train.bench.scan prints the same):
forward reads u, delta (50 MB each), B, C (1 MB each), writes out (50 MB): ~0.15 GB in 12,288
programs at BLOCK_D = 4 (93 per SM on an H200, so the tail is short). Backward reads u, delta, dout,
B, C and writes du, ddelta (~0.25 GB) plus the dB, dC partials below (25 MB, then read by torch).

Backward recomputes instead of storing. Forward stores only the state entering each CHUNK-step chunk
after the first, (b, d, chunks - 1, n): nothing at l <= CHUNK. Backward rebuilds a chunk's states from
it with the same per-state scan and runs the adjoint dh_t = a_{t+1} dh_{t+1} + C_t dy_t as a reverse
scan; a_{t+1} comes from delta loaded one step later (a cached re-read, one exp2 per element), which is
cheaper than shifting a register tile. The decay gradient needs a_t h_{t-1}; h_t - x_t would cancel
catastrophically when a_t ~ 0 (on a GPU the compiler fuses x_t = delta u B into that subtraction as an
FMA, leaving the product's rounding error, times |A| ~ 1e4, in d delta), so the forward scan carries a
third component that is a_t h_{t-1} itself: (a1, x1, s1) o (a2, x2, s2) = (a1 a2, a2 x1 + x2, a2 x1 + s2).

dB and dC are sums over channels. Deterministically (no atomics): a backward program owns CPP channels
(a multiple of every tuned BLOCK_D, fixed by the shape so the partial buffer does not depend on the
tuned config), walks them BLOCK_D at a time and adds each block's sums into its own (n, l) partial row
(L2-resident); torch sums the b * d / CPP partials. CPP is the largest of 8..64 that still gives >= 512
programs, so the partials stay at about 1/8 of the (b, d, l) traffic.

Autotune: forward chooses BLOCK_D and num_warps on first use per (d, l, n, flags, dtypes), backward between
BLOCK_D 2 at 8 warps and BLOCK_D 4 at 16 (without z): the configs that compile for sm_90 without register spills
at CHUNK 256 (`python -m train.bench.kernel_compile` prints registers and spills of every config). CHUNK and
CPP are fixed by the shape, so the states forward stores and the partials backward writes never depend
on the tuned config. Under TRITON_INTERPRET=1 each kernel has one small config.

Precision: fp32 state and sums for fp32 / bf16 / fp16 inputs (loaded in their dtype, widened in
registers); fp64 inputs compute in fp64 (exp instead of exp2). Output in u's dtype, each gradient in
its input's dtype. Stability: with delta >= 0 and A < 0 every factor is in (0, 1]; nothing is divided.
"""

from __future__ import annotations

import torch
import triton
from torch.autograd.function import once_differentiable
from triton.runtime.interpreter import InterpretedFunction

from backbones.ops.autocast import fp32_operator
# The @triton.jit kernels live beside this file; the combine functions are re-exported for the tests.
from backbones.ops.selective_scan_triton_kernels import _compose, _compose_pre, _scan_bwd_kernel, _scan_fwd_kernel  # noqa: F401

# Steps per chunk, the most: a (BLOCK_D, 256) tile per live value keeps forward's live tiles within registers
# for BLOCK_D <= 4 and backward's ~20 for BLOCK_D <= 2 (ptxas, sm_90), and 256 tokens (the project's usual
# sequence) take one chunk.
MAX_CHUNK = 256
# Backward programs wanted before channels per program (CPP) stops growing: ~4 per SM on an H100/H200.
_MIN_BWD_PROGRAMS = 512


# Under TRITON_INTERPRET=1 (read when the kernels are decorated) they run on CPU tensors, through numpy.
_INTERPRETED = isinstance(_scan_fwd_kernel, InterpretedFunction)


def _configs(shapes: tuple[tuple[int, int], ...]) -> list[triton.Config]:
    """(BLOCK_D, num_warps) pairs as autotune configs."""
    if _INTERPRETED:  # the interpreter would run every config; one small one exercises the same code
        return [triton.Config({"BLOCK_D": 4}, num_warps=1)]
    return [triton.Config({"BLOCK_D": bd}, num_warps=w) for bd, w in shapes]


# Keyed on the shape and the flags; the autotuner adds every tensor argument's dtype to the key itself.
_KEY = ["d", "g", "L", "N", "HAS_D", "HAS_Z", "HAS_BIAS", "CHUNK"]
# Only configs that compile for sm_90 without register spills at CHUNK = 256 (`python -m
# train.bench.kernel_compile`, ptxas 12.9). At 4 and 8 warps, forward BLOCK_D 8 and 16 spill 52-688 bytes per
# thread, backward BLOCK_D 4 spills 32-184 and BLOCK_D 8 332-1380, and backward BLOCK_D 2 at 4 warps 8-12 with the
# Mamba block's flags (D, delta_bias, softplus). 16 warps spread the larger tiles: forward BLOCK_D 8 and backward
# BLOCK_D 4 fit in 128 registers with Triton 3.8, except backward BLOCK_D 4 with z (16 bytes), which `_prune_backward`
# drops; with Triton 3.6 (the H100 image) they spill 4 bytes (forward, every flag) and 24-32 (backward, the Mamba
# block's flags), small enough to leave to the autotuner's timing. The one H100 run (docs/gpu/h100-2026-11-26b) found
# both kernels bound by the latency of many small tile scans, so these larger tiles are candidates the autotuner
# times, not a measured improvement. BLOCK_D must divide CPP (>= 8) in backward.
_WIDE_BACKWARD = (4, 16)  # (BLOCK_D, num_warps)
FWD_CONFIGS = ((2, 4), (4, 4), (4, 8), (8, 16))  # (BLOCK_D, num_warps) on a GPU
BWD_CONFIGS = ((2, 8), _WIDE_BACKWARD)


def _prune_backward(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The backward configs that compile without spills for these flags: the wide one only without z."""
    if not kwargs.get("HAS_Z"):
        return configs
    return [c for c in configs if (c.kwargs["BLOCK_D"], c.num_warps) != _WIDE_BACKWARD]


fwd_kernel = triton.autotune(configs=_configs(FWD_CONFIGS), key=_KEY)(_scan_fwd_kernel)
bwd_kernel = triton.autotune(configs=_configs(BWD_CONFIGS), key=_KEY,
                             prune_configs_by={"early_config_prune": _prune_backward})(_scan_bwd_kernel)

def time_chunk(length: int) -> int:
    """Steps per chunk: the sequence rounded up to a power of two (at least 16), at most MAX_CHUNK."""
    return min(MAX_CHUNK, max(16, triton.next_power_of_2(length)))


def channels_per_program(b: int, g: int, k: int) -> int:
    """Backward's channels per program: the largest of 8..64 (powers of two) that leaves >= 512 programs."""
    cpp = 64
    while cpp > 8 and b * g * triton.cdiv(k, cpp) < _MIN_BWD_PROGRAMS:
        cpp //= 2
    return cpp


def states_shape(b: int, d: int, length: int, n: int) -> tuple[int, int, int, int]:
    """Shape of the chunk states forward keeps for backward: (b, d, chunks - 1, n)."""
    return b, d, triton.cdiv(length, time_chunk(length)) - 1, n


def _flags(A, D, z, delta_bias, softplus) -> dict:
    return dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(softplus),
                EXP2=A.dtype != torch.float64)


@fp32_operator
def scan_forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus: bool, store: bool):
    """Forward launch on prepared inputs (contiguous; B, C (b, g, n, l); A, D, bias in the compute dtype).

    Returns out (u's dtype) and the chunk states ((b, d, chunks - 1, n) if `store`, else empty).
    """
    b, d, length = u.shape
    g, n = B.shape[1], A.shape[1]
    chunk = time_chunk(length)
    n_chunks = triton.cdiv(length, chunk)
    out = torch.empty_like(u)
    states = u.new_empty(states_shape(b, d, length, n) if store else (0,), dtype=A.dtype)
    grid = lambda meta: (g * triton.cdiv(d // g, meta["BLOCK_D"]), b)  # noqa: E731
    absent = A  # stands in for absent optional tensors; the constexpr flags keep it unread
    fwd_kernel[grid](
        u, delta, A, B, C, absent if D is None else D, absent if z is None else z,
        absent if delta_bias is None else delta_bias, out, states if states.numel() else absent,
        d, g, length, n, n_chunks, **_flags(A, D, z, delta_bias, delta_softplus),
        STORE_STATES=store, BLOCK_N=triton.next_power_of_2(n), CHUNK=chunk,
    )
    return out, states


@fp32_operator
def scan_backward(dout, u, delta, A, B, C, D, z, delta_bias, delta_softplus: bool, states):
    """Backward launch on the inputs scan_forward took and its states: (du, ddelta, dA, dB, dC, dD, dz, dbias).

    dB, dC are (b, g, n, l) in B's / C's dtype; dA, dD, dbias in the compute dtype; absent inputs get None.
    """
    b, d, length = u.shape
    g, n = B.shape[1], A.shape[1]
    chunk = time_chunk(length)
    cpp = channels_per_program(b, g, d // g)
    parts = triton.cdiv(d // g, cpp)
    acc = A.dtype
    du, ddelta = torch.empty_like(u), torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else None
    # Sums still to be taken by torch: over the batch (A, D, delta_bias) and over channel super-blocks (B, C).
    dA = u.new_empty(b, d, n, dtype=acc)
    dD = u.new_empty(b, d, dtype=acc) if D is not None else None
    dbias = u.new_empty(b, d, dtype=acc) if delta_bias is not None else None
    dB = u.new_empty(b, g, parts, n, length, dtype=acc)
    dC = torch.empty_like(dB)
    absent = A
    bwd_kernel[(g * parts, b)](
        u, delta, A, B, C, absent if D is None else D, absent if z is None else z,
        absent if delta_bias is None else delta_bias, dout.contiguous(), states if states.numel() else absent,
        du, ddelta, absent if dz is None else dz, dA, dB, dC, absent if dD is None else dD,
        absent if dbias is None else dbias,
        d, g, length, n, triton.cdiv(length, chunk), **_flags(A, D, z, delta_bias, delta_softplus),
        BLOCK_N=triton.next_power_of_2(n), CHUNK=chunk, CPP=cpp,
    )
    dB, dC = dB.sum(2).to(B.dtype), dC.sum(2).to(C.dtype)  # (b, g, parts, n, l) -> (b, g, n, l)
    return (du, ddelta, dA.sum(0), dB, dC, dD.sum(0) if dD is not None else None, dz,
            dbias.sum(0) if dbias is not None else None)


def prepare(u, delta, A, B, C, D=None, z=None, delta_bias=None):
    """Checks shapes and device; returns the kernels' inputs: contiguous, B and C grouped (b, g, n, l),
    A / D / delta_bias in the compute dtype (fp32, or fp64 for fp64 u)."""
    if B.dim() != C.dim() or B.dim() not in (3, 4):
        raise ValueError(f"B and C must both be (b, n, l) or (b, g, n, l); got {tuple(B.shape)} and {tuple(C.shape)}")
    if B.dim() == 4 and u.shape[1] % B.shape[1]:
        raise ValueError(f"channels d={u.shape[1]} are not divisible by the {B.shape[1]} groups of B and C")
    if not (u.is_cuda or _INTERPRETED):
        raise ValueError("selective_scan_triton needs CUDA tensors (or TRITON_INTERPRET=1 set before import, "
                         "for tests); on CPU use backbones.ops.selective_scan.selective_scan")
    acc = torch.float64 if u.dtype == torch.float64 else torch.float32
    if B.dim() == 3:
        B, C = B[:, None], C[:, None]  # (b, n, l) -> (b, 1, n, l)
    return (u.contiguous(), delta.contiguous(), A.to(acc).contiguous(), B.contiguous(), C.contiguous(),
            D.to(acc).contiguous() if D is not None else None, z.contiguous() if z is not None else None,
            delta_bias.to(acc).contiguous() if delta_bias is not None else None)


class _TritonScan(torch.autograd.Function):
    """The fused scan in eager mode; inputs as `prepare` returns them (the custom op is the compiled path)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, store):
        out, states = scan_forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus, store)
        if store:
            ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states)
            ctx.delta_softplus = delta_softplus
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        u, delta, A, B, C, D, z, delta_bias, states = ctx.saved_tensors
        grads = scan_backward(dout, u, delta, A, B, C, D, z, delta_bias, ctx.delta_softplus, states)
        return *grads, None, None


@fp32_operator
def selective_scan_triton(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
) -> torch.Tensor:
    """The selective scan as fused Triton kernels; fp32 state (fp64 for fp64 u), returns u's dtype.

    Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, for tests).
    """
    inputs = prepare(u, delta, A, B, C, D, z, delta_bias)
    # Without a gradient to compute, forward skips storing the chunk states.
    store = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    return _TritonScan.apply(*inputs, bool(delta_softplus), store)
