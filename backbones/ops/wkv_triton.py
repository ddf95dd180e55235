"""Bi-WKV as fused Triton kernels, forward and backward. The PyTorch op in backbones/ops/wkv.py stays the CPU
path and the reference these kernels are tested against (tests/test_wkv_triton.py); backbones/ops/wkv_op.py
registers both as one torch.library op; the device functions (the walks along a chunk) are in
backbones/ops/wkv_triton_walks.py.

    y_t = sum_i K(t, i) e^{k_i} v_i / sum_i K(t, i) e^{k_i},   K(t, t) = e^u,  K(t, i) = e^{-(|t-i|-1) w}

w, u: (C,) per-channel decay and bonus, already divided by T by the caller; k, v: (B, T, C).

Why chunk-parallel. The work is tiny (about 30 flops and 4 exponentials per element and pass) and the bytes
are few (B64 T256 C384 bf16: 38 MB to read k, v and write y), so the kernel is neither compute- nor
bandwidth-bound: it is bound by latency, the chain of dependent exponentials of a sequential walk and the wait
for each tile of loads. One program per (sequence, 32 channels) walking all of T gives 768 one-warp programs
at the reference shape, about 1.5 warps per SM sub-partition with nothing to switch to while one waits. So the
sequence is cut into chunks of CHUNK = 16 tokens and every (sequence, channel block, chunk) is a program of its
own (12,288 at the reference shape, 93 per SM, of which registers let 9 to 14 run at once): each walks only its
16 tokens, and what it receives from outside its chunk arrives as two carries computed beforehand.

Three launches per direction. (1) `sums`: per chunk, what it adds to the carries of its neighbours, from empty
carries: two independent 16-step walks over its rows (left to right, right to left), so the chains are short and
two are in flight per thread. (2) `combine`: per (sequence, channel block), the carry entering each chunk from the
left and from the right, a walk over the T / 16 chunk aggregates (16 steps at T = 256; the aggregates of 16 chunks
are loaded at once, so there is one load latency per 16 steps, not one per step). (3) `main`: per chunk, the same
walk as a whole-sequence kernel, right to left then left to right over the 16 rows held in registers, starting
from the two carries. Picking a row of a (16, BLOCK_C) tile is a register move only while all 16 rows of a channel
sit in one thread, which holds for the configs below (BLOCK_C a multiple of 32 * num_warps: the tile layout is
then threads along channels only, checked in the TTGIR for sm_90).

Backward. With D_t the denominator, alpha_t = g_t / D_t and beta_t = -g_t y_t / D_t (g = dL/dy):
  dk_i = e^{k_i} sum_t K(t, i) (alpha_t v_i + beta_t),   dv_i = e^{k_i} sum_t K(t, i) alpha_t,
  du   = sum_t e^{u + k_t} (alpha_t v_t + beta_t),
  dw   = -sum_t sum_{i != t} (|t-i| - 1) K(t, i) e^{k_i} (alpha_t v_i + beta_t).
K is symmetric, so the sums over t are the same two carries run over [alpha, beta] (R from the right, L from
the left), each with a distance-weighted twin R'_{t-1} = e^{-w} (R'_t + R_t) for dw. Moving a carry by a whole
chunk: R -> e^{-16 w} R, R' -> e^{-16 w} (R' + 16 R), so the same three launches apply.
What the backward recomputes rather than stores: y and D_t. Storing them in fp32 (y, and D as scale and
mantissa) is 12 bytes per element written once and read twice, 226 MB at the reference shape; recomputing
costs one more 16-token walk per chunk in each backward launch, from the forward's chunk carries, which are the
only thing the forward saves (6 floats per (sequence, chunk, channel), 9 MB). That is why the chunk length is a
fixed function of T (`chunk_len`), not an autotuned parameter: the backward must cut the sequence where the
forward did. Autotuning picks only the channels per program and the warps, which change no stored layout.

Bytes at B64 T256 C384 bf16 (`traffic`): forward 101 MB, backward 189 MB, 289 MB in all, 86 us at an H100's
3.35 TB/s; the goal is 400 us. The chunk scratch (aggregates and carries, 6 + 10 floats per chunk slot) is
about 40% of it; longer chunks would cut it but hold more rows in registers: with 16 rows the backward's main
kernel, which holds eight (16, BLOCK_C) tiles, takes 218 (bf16) to 238 (fp32) of a thread's 255 registers (ptxas,
sm_90, built as launched).

Numerics (why fp32 is enough). Every carry is (integer log-scale h, mantissas): the value is e^h times the
mantissas. h follows the carry's magnitude (log-sum-exp style, max of the decayed scale and the new term) and is
rounded to an integer, so each step's factor exp((h_old - h_new) - w) is taken of a small, correctly rounded
number and the error does not grow with |h|. Moving a carry by a chunk takes exp((h_old - h_new) - 16 w), exact
in the same way (16 w is exact). No exponent of an unbounded quantity is taken. Empty carries use the finite scale
_NEG (not -inf) so that scale differences never form inf - inf. bf16 / fp16 inputs are read in their dtype and
computed in fp32; y, dk, dv come back in the input dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from backbones.ops import wkv_triton_fused
from backbones.ops.triton_launch import launch
from backbones.ops.wkv_env import wkv_kernel
from backbones.ops.wkv_triton_walks import (
    _NEG,
    _SHAPE_ARGS,
    _alpha_beta,
    _bwd_tile,
    _chunk_sums,
    _chunk_sums_grad,
    _cols,
    _fwd_tile,
    _load_bwd_carries,
    _load_fwd_carries,
    _push,
    _push_grad,
    _row,
    _slot,
    _tile,
)

# Chunks per load in the combine walk: a (16, BLOCK_C) tile of aggregates per field, its rows in registers. Under
# the interpreter 2, so that the tests' few chunks cross a group boundary (in both walking directions).
_GROUP = 2 if os.environ.get("TRITON_INTERPRET") == "1" else 16
_GROUP_PARTS = min(_GROUP, 8)  # the walk over a group, as unrolled copies of a 2-step loop (wkv_triton_walks._PARTS)




def chunk_len(T: int) -> int:
    """Tokens per chunk: fixed (not autotuned), so the backward cuts the sequence where the forward did."""
    return 16


def _configs() -> list[triton.Config]:
    """Channels per program and warps. Under TRITON_INTERPRET=1 one config: the interpreter would run them all."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BLOCK_C": 32}, num_warps=1)]
    # Rows stay in-thread only with threads along channels: BLOCK_C a multiple of 32 * num_warps. Two channels per
    # thread (64 on one warp) spill in the backward, and in the forward LLVM leaves its walks rolled (the picks become
    # selects; `train.bench.kernel_compile`), so neither direction tries it. Few configs: each is compiled on first
    # use (seconds per kernel), and the choice is mostly the CTA size.
    shapes = [(32, 1), (128, 4)]
    return [triton.Config({"BLOCK_C": bc}, num_warps=nw) for bc, nw in shapes]


@triton.autotune(configs=_configs(), key=["T", "C"])
@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _fwd_sums_kernel(w_ptr, k_ptr, v_ptr, agg_ptr, B, T, C, n_chunks, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """(6, B, n, C) aggregates [scale, num, den] of each chunk: as the next chunk's first token sees it (left
    side, fields 0-2) and as the previous chunk's last token sees it (right side, fields 3-5)."""
    b = tl.program_id(0)
    _, _, K, V = _tile(k_ptr, v_ptr, b, T, C, BLOCK_T, BLOCK_C)
    slot, col_ok = _slot(b, n_chunks, C, BLOCK_C)
    field = B * n_chunks * C
    w = tl.load(w_ptr + _cols(BLOCK_C), mask=col_ok, other=0.0)
    sums = _chunk_sums(K, V, tl.arange(0, BLOCK_T), w, tl.program_id(2) * BLOCK_T, T, BLOCK_T)
    for i in tl.static_range(6):
        tl.store(agg_ptr + slot + i * field, sums[i], mask=col_ok)


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _combine_kernel(w_ptr, agg_ptr, carry_ptr, B, n_chunks, C, FIELDS: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_C: tl.constexpr, GROUP: tl.constexpr, PARTS: tl.constexpr):
    """Carries entering each chunk from (FIELDS, B, n, C) chunk aggregates, left side ascending, right side
    descending. FIELDS = 6: forward [scale, num, den] per side; 10: backward [scale, R_a, R_b, R'_a, R'_b]."""
    b = tl.program_id(0)
    cols = _cols(BLOCK_C)
    col_ok = cols < C
    rows = tl.arange(0, GROUP)
    field = B * n_chunks * C
    base = b * n_chunks * C + cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
    n_groups = tl.cdiv(n_chunks, GROUP)
    PER: tl.constexpr = FIELDS // 2
    for side in tl.static_range(2):
        h = tl.full([BLOCK_C], _NEG, tl.float32)
        A = tl.zeros([BLOCK_C], tl.float32)
        D = tl.zeros([BLOCK_C], tl.float32)
        Sa = tl.zeros([BLOCK_C], tl.float32)
        Sb = tl.zeros([BLOCK_C], tl.float32)
        for gi in range(n_groups):
            g0 = (gi + side * (n_groups - 1 - 2 * gi)) * GROUP  # ascending groups on the left, descending on the right
            c = g0 + rows
            offs = base[None, :] + c[:, None] * C + PER * side * field
            m = (c < n_chunks)[:, None] & col_ok[None, :]
            Hs = tl.load(agg_ptr + offs, mask=m, other=_NEG)
            As = tl.load(agg_ptr + offs + field, mask=m, other=0.0)
            Ds = tl.load(agg_ptr + offs + 2 * field, mask=m, other=0.0)
            if FIELDS == 10:
                Xs = tl.load(agg_ptr + offs + 3 * field, mask=m, other=0.0)
                Ws = tl.load(agg_ptr + offs + 4 * field, mask=m, other=0.0)
            for part in tl.static_range(PARTS):
                for step in range(GROUP // PARTS):
                    jj = part * (GROUP // PARTS) + step
                    j = jj + side * (GROUP - 1 - 2 * jj)  # rows walked in the side's direction
                    ok = col_ok & (g0 + j < n_chunks)
                    out = carry_ptr + base + (g0 + j) * C + PER * side * field
                    tl.store(out, h, mask=ok)
                    tl.store(out + field, A, mask=ok)
                    tl.store(out + 2 * field, D, mask=ok)
                    if FIELDS == 10:
                        tl.store(out + 3 * field, Sa, mask=ok)
                        tl.store(out + 4 * field, Sb, mask=ok)
                        h2, A2, D2, Sa2, Sb2 = _push_grad(h, A, D, Sa, Sb, BLOCK_T * w, BLOCK_T, _row(Hs, rows, j),
                                                          _row(As, rows, j), _row(Ds, rows, j), _row(Xs, rows, j),
                                                          _row(Ws, rows, j))
                        Sa = tl.where(ok, Sa2, Sa)
                        Sb = tl.where(ok, Sb2, Sb)
                    else:
                        h2, A2, D2 = _push(h, A, D, BLOCK_T * w, _row(Hs, rows, j), _row(As, rows, j), _row(Ds, rows, j))
                    h = tl.where(ok, h2, h)
                    A = tl.where(ok, A2, A)
                    D = tl.where(ok, D2, D)


@triton.autotune(configs=_configs(), key=["T", "C"])
@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _fwd_kernel(w_ptr, u_ptr, k_ptr, v_ptr, carry_ptr, y_ptr, B, T, C, n_chunks,
                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    offs, mask, K, V = _tile(k_ptr, v_ptr, b, T, C, BLOCK_T, BLOCK_C)
    slot, col_ok = _slot(b, n_chunks, C, BLOCK_C)
    w = tl.load(w_ptr + _cols(BLOCK_C), mask=col_ok, other=0.0)
    u = tl.load(u_ptr + _cols(BLOCK_C), mask=col_ok, other=0.0)
    carries = _load_fwd_carries(carry_ptr, slot, col_ok, B * n_chunks * C)
    Y, _, _ = _fwd_tile(K, V, tl.arange(0, BLOCK_T), w, u, *carries, tl.program_id(2) * BLOCK_T, T, BLOCK_T)
    tl.store(y_ptr + offs, Y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_configs(), key=["T", "C"])
@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _bwd_sums_kernel(w_ptr, u_ptr, k_ptr, v_ptr, gy_ptr, fcarry_ptr, agg_ptr, B, T, C, n_chunks,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """(10, B, n, C) backward aggregates [scale, R_a, R_b, R'_a, R'_b] of each chunk, left side then right."""
    b = tl.program_id(0)
    offs, mask, K, V = _tile(k_ptr, v_ptr, b, T, C, BLOCK_T, BLOCK_C)
    slot, col_ok = _slot(b, n_chunks, C, BLOCK_C)
    field = B * n_chunks * C
    w = tl.load(w_ptr + _cols(BLOCK_C), mask=col_ok, other=0.0)
    u = tl.load(u_ptr + _cols(BLOCK_C), mask=col_ok, other=0.0)
    carries = _load_fwd_carries(fcarry_ptr, slot, col_ok, field)
    Y, Pt, Dt = _fwd_tile(K, V, tl.arange(0, BLOCK_T), w, u, *carries, tl.program_id(2) * BLOCK_T, T, BLOCK_T)
    S_, Al, Be = _alpha_beta(gy_ptr, offs, mask, Y, Pt, Dt)
    sums = _chunk_sums_grad(S_, Al, Be, tl.arange(0, BLOCK_T), w, tl.program_id(2) * BLOCK_T, T, BLOCK_T)
    for i in tl.static_range(10):
        tl.store(agg_ptr + slot + i * field, sums[i], mask=col_ok)


@triton.autotune(configs=_configs(), key=["T", "C"])
@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _bwd_kernel(w_ptr, u_ptr, k_ptr, v_ptr, gy_ptr, fcarry_ptr, bcarry_ptr, dk_ptr, dv_ptr, part_ptr,
                B, T, C, n_chunks, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    offs, mask, K, V = _tile(k_ptr, v_ptr, b, T, C, BLOCK_T, BLOCK_C)
    slot, col_ok = _slot(b, n_chunks, C, BLOCK_C)
    field = B * n_chunks * C
    rows = tl.arange(0, BLOCK_T)
    t0 = tl.program_id(2) * BLOCK_T
    w = tl.load(w_ptr + _cols(BLOCK_C), mask=col_ok, other=0.0)
    u = tl.load(u_ptr + _cols(BLOCK_C), mask=col_ok, other=0.0)
    carries = _load_fwd_carries(fcarry_ptr, slot, col_ok, field)
    Y, Pt, Dt = _fwd_tile(K, V, rows, w, u, *carries, t0, T, BLOCK_T)
    S_, Al, Be = _alpha_beta(gy_ptr, offs, mask, Y, Pt, Dt)

    right = _load_bwd_carries(bcarry_ptr, slot + 5 * field, col_ok, field)
    dK, dV, du, dw = _bwd_tile(K, V, S_, Al, Be, rows, w, u, *right, bcarry_ptr + slot, col_ok, field, t0, T, BLOCK_T,
                               dk_ptr, dv_ptr, C, col_ok, False)

    tl.store(dk_ptr + offs, dK.to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptr + offs, dV.to(dv_ptr.dtype.element_ty), mask=mask)
    # Per-chunk partial sums; the caller adds them (deterministic, no atomics).
    tl.store(part_ptr + slot, du, mask=col_ok)
    tl.store(part_ptr + slot + field, dw, mask=col_ok)


def _launch_shape(k: torch.Tensor):
    B, T, C = k.shape
    L = chunk_len(T)
    n = triton.cdiv(T, L)
    return B, T, C, L, n, lambda meta: (B, triton.cdiv(C, meta["BLOCK_C"]), n)


def _combine(w: torch.Tensor, agg: torch.Tensor, L: int) -> torch.Tensor:
    fields, B, n, C = agg.shape
    carries = torch.empty_like(agg)
    # One warp per 32 channels: the walk is n short steps, and its tiles keep rows in-thread.
    _combine_kernel[(B, triton.cdiv(C, 32))](w, agg, carries, B, n, C, FIELDS=fields, BLOCK_T=L, BLOCK_C=32,
                                              GROUP=_GROUP, PARTS=_GROUP_PARTS, num_warps=1)
    return carries


def forward(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y (B, T, C) in k's dtype and the chunk carries (6, B, n, C) the backward needs; w, u fp32 (C,);
    k, v contiguous of one dtype. TREAD_WKV_KERNEL=fused: one launch (backbones/ops/wkv_triton_fused.py)."""
    if wkv_kernel() == "fused":
        return wkv_triton_fused.forward(w, u, k, v, chunk_len(k.shape[1]))
    B, T, C, L, n, grid = _launch_shape(k)
    key = (T, C, k.dtype, k.device)  # the autotuner's key: T, C and the tensors' dtypes (w, u, scratch are fp32)
    agg = torch.empty(6, B, n, C, device=k.device, dtype=torch.float32)
    launch(_fwd_sums_kernel, key, grid, w, k, v, agg, B, T, C, n, BLOCK_T=L)
    carries = _combine(w, agg, L)
    y = torch.empty_like(k)
    launch(_fwd_kernel, key, grid, w, u, k, v, carries, y, B, T, C, n, BLOCK_T=L)
    return y, carries


def backward(w, u, k, v, carries, grad_y) -> tuple[torch.Tensor, ...]:
    """(du, dw) as one fp32 (2, C) tensor, dk, dv (k's dtype), from the forward's inputs and chunk carries (either
    kernel's). TREAD_WKV_KERNEL=fused: one launch."""
    if wkv_kernel() == "fused":
        return wkv_triton_fused.backward(w, u, k, v, carries, grad_y, chunk_len(k.shape[1]))
    B, T, C, L, n, grid = _launch_shape(k)
    grad_y = grad_y.contiguous()
    key = (T, C, k.dtype, grad_y.dtype, k.device)
    agg = torch.empty(10, B, n, C, device=k.device, dtype=torch.float32)
    launch(_bwd_sums_kernel, key, grid, w, u, k, v, grad_y, carries, agg, B, T, C, n, BLOCK_T=L)
    bcarries = _combine(w, agg, L)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    partial = torch.empty(2, B, n, C, device=k.device, dtype=torch.float32)
    launch(_bwd_kernel, key, grid, w, u, k, v, grad_y, carries, bcarries, dk, dv, partial, B, T, C, n, BLOCK_T=L)
    return partial.sum(dim=(1, 2)), dk, dv  # (2, B, n, C) -> (2, C): du and dw in one reduction


class _TritonBiWKV(torch.autograd.Function):
    """The kernels in eager mode, called directly: no custom-op dispatch (wkv_op's op is the compiled path)."""

    @staticmethod
    def forward(ctx, w, u, k, v):
        y, carries = forward(w, u, k, v)
        ctx.save_for_backward(w, u, k, v, carries)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        w, u, k, v, carries = ctx.saved_tensors
        du_dw, dk, dv = backward(w, u, k, v, carries, grad_y)
        return du_dw[1], du_dw[0], dk, dv


def bi_wkv_triton(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """y (B, T, C) of the kernels with autograd, in eager mode; inputs as `forward` takes them."""
    return _TritonBiWKV.apply(w, u, k, v)


def traffic(B: int, T: int, C: int, element_size: int, block_c: int = 32) -> dict[str, list[tuple[str, int, int]]]:
    """The launches of `forward` and `backward` as (name, bytes moved, programs), each tensor counted once per
    launch that reads or writes it (w and u, C floats, left out). block_c: channels per program, as picked."""
    L = chunk_len(T)
    n = triton.cdiv(T, L)
    x = B * T * C * element_size  # one (B, T, C) tensor in k's dtype
    slot = B * n * C * 4  # one fp32 field of a chunk scratch
    tiles = B * triton.cdiv(C, block_c) * n
    walks = B * triton.cdiv(C, 32)
    return {
        "forward": [
            ("sums", 2 * x + 6 * slot, tiles),  # read k, v; write aggregates
            ("combine", 12 * slot, walks),  # read aggregates, write carries
            ("main", 3 * x + 6 * slot, tiles),  # read k, v, carries; write y
        ],
        "backward": [
            ("sums", 3 * x + 16 * slot, tiles),  # read k, v, dy, forward carries; write aggregates
            ("combine", 20 * slot, walks),
            ("main", 5 * x + 18 * slot, tiles),  # read k, v, dy, both carries; write dk, dv, du/dw partials
            ("du, dw sums", 2 * slot, 1),  # one torch reduction
        ],
    }
