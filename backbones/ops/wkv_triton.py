"""Bi-WKV as fused Triton kernels, forward and backward. The PyTorch op in backbones/ops/wkv.py stays the CPU
path and the reference these kernels are tested against (tests/test_wkv_triton.py).

    y_t = sum_i K(t, i) e^{k_i} v_i / sum_i K(t, i) e^{k_i},   K(t, t) = e^u,  K(t, i) = e^{-(|t-i|-1) w}

w, u: (C,) per-channel decay and bonus, already divided by T by the caller; k, v: (B, T, C).

Scheme. One program per (batch, block of BLOCK_C channels) walks the sequence. Every quantity is a carry of
the recurrence "decay by one token, then add the next token", run in both directions:
  G_t = sum_{i<t} e^{-(t-1-i) w} e^{k_i} [v_i, 1]   (left carry, G_{t+1} = e^{-w} G_t + e^{k_t} [v_t, 1])
  H_t = sum_{i>t} e^{-(i-t-1) w} e^{k_i} [v_i, 1]   (right carry, mirrored)
  y_t = (G_t + e^{u + k_t} [v_t, 1] + H_t), numerator over denominator.
The sequence is read in tiles of BLOCK_T tokens, each loaded at once so that many loads are in flight (a
token-by-token loop would wait one memory latency per token), then walked token by token in registers.
A first right-to-left sweep keeps only the right carry entering each tile (O(T / BLOCK_T) state); the second
sweep walks each tile right to left from that carry, then left to right with the running left carry, and
writes y. So k and v are read twice and y written once, with no O(T) scratch.

Backward. With D_t the denominator, alpha_t = g_t / D_t and beta_t = -g_t y_t / D_t (g = dL/dy):
  dk_i = e^{k_i} sum_t K(t, i) (alpha_t v_i + beta_t),   dv_i = e^{k_i} sum_t K(t, i) alpha_t,
  du   = sum_t e^{u + k_t} (alpha_t v_t + beta_t),
  dw   = -sum_t sum_{i != t} (|t-i| - 1) K(t, i) e^{k_i} (alpha_t v_i + beta_t).
K is symmetric, so the sums over t are the same two carries run over [alpha, beta] instead of e^k [v, 1]
(L_t from the left, R_t from the right). The distance weight of dw comes from a second carry beside each,
R'_{t-1} = e^{-w} (R'_t + R_t) (likewise L'), which holds sum_{s>t} (s-t-1) e^{-(s-t-1) w} [alpha_s, beta_s];
then dw = -sum_i e^{k_i} (v_i (L'_i + R'_i)[alpha] + (L'_i + R'_i)[beta]). Same sweeps as the forward: right
carries at tile boundaries first, then each tile right to left and left to right. The forward saves y in
fp32 and D_t as (P_t, d_t) with D_t = e^{P_t} d_t, so the backward never recomputes G and H.

Numerics (why fp32 is enough). Every carry is (integer log-scale h, mantissas): the value is e^h times the
mantissas. h follows the carry's magnitude (log-sum-exp style, max of the decayed scale and the new token)
and is rounded to an integer, so each step's factor exp((h_old - h_new) - w) is taken of a small, correctly
rounded number: the error per token is ~1e-7 however large |h| grows (a float scale loses ulp(h) per step,
1e-5 once |w| t reaches ~200). No exponent of an unbounded quantity is taken: e^{k - h} <= e^{0.5}, and the
backward's e^{k_i + h} is the attention weight K e^{k_i} / D_t <= 1 times a mantissa. Empty carries use the
finite scale _NEG (not -inf) so that scale differences never form inf - inf.
bf16 / fp16 inputs are read in their dtype and computed in fp32; y, dk, dv come back in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Log-scale of an empty carry: finite, so that differences of scales never give inf - inf.
_NEG = tl.constexpr(-1.0e30)
# Tokens loaded and walked per tile, channels per program, and one warp per program: with one warp a
# (BLOCK_T, BLOCK_C) tile puts one channel on each lane and all BLOCK_T rows of it in that lane's registers,
# so picking a row is a register move (checked in the TTGIR for sm_90; more warps split the rows across
# warps and every row pick goes through shared memory). Compiled for sm_90 without a GPU, ptxas reports
# 164 registers for the forward and 254 (16 bytes spilled) for the backward. Not tuned on hardware.
BLOCK_T = 16
BLOCK_C = 32
NUM_WARPS = 1


@triton.jit
def _row(tile, rows, j: tl.constexpr):
    """Row j of a (BLOCK_T, BLOCK_C) tile as a (BLOCK_C,) vector (a register pick when rows live in-thread)."""
    return tl.sum(tl.where(rows[:, None] == j, tile, 0.0), axis=0)


@triton.jit
def _put(tile, rows, j: tl.constexpr, row):
    """The tile with row j replaced by `row`."""
    return tl.where(rows[:, None] == j, row[None, :], tile)


@triton.jit
def _push(h, A, D, w, k, v):
    """Carry e^h [A, D] -> e^{-w} carry + e^k [v, 1]; the new scale is an integer (see the module docstring)."""
    h_new = tl.floor(tl.maximum(h - w, k) + 0.5)
    f = tl.exp((h - h_new) - w)
    g = tl.exp(k - h_new)
    return h_new, A * f + g * v, D * f + g


@triton.jit
def _push_grad(h, Ra, Rb, Sa, Sb, w, s, a, b):
    """Backward carries e^h [Ra, Rb] (R) and e^h [Sa, Sb] (R', the distance-weighted one) past one token
    whose [alpha, beta] = e^s [a, b]: R' <- e^{-w} (R' + R), then R <- e^{-w} R + [alpha, beta]."""
    h_new = tl.floor(tl.maximum(h - w, s) + 0.5)
    f = tl.exp((h - h_new) - w)
    g = tl.exp(s - h_new)
    return h_new, Ra * f + g * a, Rb * f + g * b, (Sa + Ra) * f, (Sb + Rb) * f


@triton.jit
def _bi_wkv_fwd_kernel(
    w_ptr, u_ptr, k_ptr, v_ptr, y_ptr, y32_ptr, P_ptr, d_ptr, carry_ptr,
    B, T, C, n_tiles,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, STORE_Y32: tl.constexpr, SAVE: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    rows = tl.arange(0, BLOCK_T)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    seq = b.to(tl.int64) * T * C  # offset of sequence b in (B, T, C)
    # The carry entering tile i sits at carry_ptr[field, b, i, c] of a (3, B, n_tiles, C) scratch.
    field = B * n_tiles * C
    carry_row = carry_ptr + (b * n_tiles) * C + cols

    # Right-to-left sweep: the right carry entering each tile.
    h = tl.full([BLOCK_C], _NEG, tl.float32)
    A = tl.zeros([BLOCK_C], tl.float32)
    D = tl.zeros([BLOCK_C], tl.float32)
    for i in range(n_tiles):
        tile = n_tiles - 1 - i
        tl.store(carry_row + tile * C, h, mask=col_ok)
        tl.store(carry_row + tile * C + field, A, mask=col_ok)
        tl.store(carry_row + tile * C + 2 * field, D, mask=col_ok)
        t = tile * BLOCK_T + rows
        offs = seq + t[:, None] * C + cols[None, :]
        mask = (t < T)[:, None] & col_ok[None, :]
        K = tl.load(k_ptr + offs, mask=mask, other=_NEG).to(tl.float32)
        V = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for jj in tl.static_range(BLOCK_T):
            j = BLOCK_T - 1 - jj  # constexpr: rows walked right to left
            # Padding rows past T come first from the right: they must leave the carry empty.
            valid = tile * BLOCK_T + j < T
            h2, A2, D2 = _push(h, A, D, w, _row(K, rows, j), _row(V, rows, j))
            h = tl.where(valid, h2, h)
            A = tl.where(valid, A2, A)
            D = tl.where(valid, D2, D)
    # The second sweep reads the carries written above, possibly by other threads of this program.
    tl.debug_barrier()

    # Left-to-right sweep: per tile, right to left from its carry (Z_t = self + H_t), then left to right.
    h = tl.full([BLOCK_C], _NEG, tl.float32)
    A = tl.zeros([BLOCK_C], tl.float32)
    D = tl.zeros([BLOCK_C], tl.float32)
    for tile in range(n_tiles):
        t = tile * BLOCK_T + rows
        offs = seq + t[:, None] * C + cols[None, :]
        mask = (t < T)[:, None] & col_ok[None, :]
        K = tl.load(k_ptr + offs, mask=mask, other=_NEG).to(tl.float32)
        V = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        hR = tl.load(carry_row + tile * C, mask=col_ok, other=_NEG)
        AR = tl.load(carry_row + tile * C + field, mask=col_ok, other=0.0)
        DR = tl.load(carry_row + tile * C + 2 * field, mask=col_ok, other=0.0)

        # Z_t = e^{u + k_t} [v_t, 1] + H_t, kept as integer scale Zh and mantissas Zn, Zd per row.
        Zh = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        Zn = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        Zd = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for jj in tl.static_range(BLOCK_T):
            j = BLOCK_T - 1 - jj  # constexpr: rows walked right to left
            k_j = _row(K, rows, j)
            v_j = _row(V, rows, j)
            m = tl.floor(tl.maximum(hR, k_j + u) + 0.5)
            e_carry = tl.exp(hR - m)
            e_self = tl.exp((k_j - m) + u)
            Zh = _put(Zh, rows, j, m)
            Zn = _put(Zn, rows, j, AR * e_carry + v_j * e_self)
            Zd = _put(Zd, rows, j, DR * e_carry + e_self)
            valid = tile * BLOCK_T + j < T
            h2, A2, D2 = _push(hR, AR, DR, w, k_j, v_j)
            hR = tl.where(valid, h2, hR)
            AR = tl.where(valid, A2, AR)
            DR = tl.where(valid, D2, DR)

        # y_t = (G_t + Z_t) under the common integer scale P_t = max(h_G, h_Z).
        Y = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        Pt = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        Dt = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(BLOCK_T):
            m = _row(Zh, rows, j)
            P = tl.maximum(h, m)
            e_left = tl.exp(h - P)
            e_z = tl.exp(m - P)
            num = A * e_left + _row(Zn, rows, j) * e_z
            den = D * e_left + _row(Zd, rows, j) * e_z
            Y = _put(Y, rows, j, num / den)
            Pt = _put(Pt, rows, j, P)
            Dt = _put(Dt, rows, j, den)
            # Rows past T only follow the last real one, so the left carry needs no mask.
            h, A, D = _push(h, A, D, w, _row(K, rows, j), _row(V, rows, j))

        tl.store(y_ptr + offs, Y.to(y_ptr.dtype.element_ty), mask=mask)
        if STORE_Y32:
            tl.store(y32_ptr + offs, Y, mask=mask)
        if SAVE:
            tl.store(P_ptr + offs, Pt, mask=mask)
            tl.store(d_ptr + offs, Dt, mask=mask)


@triton.jit
def _bi_wkv_bwd_kernel(
    w_ptr, u_ptr, k_ptr, v_ptr, gy_ptr, y32_ptr, P_ptr, d_ptr, dk_ptr, dv_ptr, du_ptr, dw_ptr, carry_ptr,
    B, T, C, n_tiles,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    rows = tl.arange(0, BLOCK_T)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    seq = b.to(tl.int64) * T * C
    # (5, B, n_tiles, C) scratch: scale, R[alpha], R[beta], R'[alpha], R'[beta] entering each tile.
    field = B * n_tiles * C
    carry_row = carry_ptr + (b * n_tiles) * C + cols

    # Right-to-left sweep: the backward right carries (R, R') entering each tile.
    h = tl.full([BLOCK_C], _NEG, tl.float32)
    Ra = tl.zeros([BLOCK_C], tl.float32)
    Rb = tl.zeros([BLOCK_C], tl.float32)
    Sa = tl.zeros([BLOCK_C], tl.float32)
    Sb = tl.zeros([BLOCK_C], tl.float32)
    for i in range(n_tiles):
        tile = n_tiles - 1 - i
        tl.store(carry_row + tile * C, h, mask=col_ok)
        tl.store(carry_row + tile * C + field, Ra, mask=col_ok)
        tl.store(carry_row + tile * C + 2 * field, Rb, mask=col_ok)
        tl.store(carry_row + tile * C + 3 * field, Sa, mask=col_ok)
        tl.store(carry_row + tile * C + 4 * field, Sb, mask=col_ok)
        t = tile * BLOCK_T + rows
        offs = seq + t[:, None] * C + cols[None, :]
        mask = (t < T)[:, None] & col_ok[None, :]
        # [alpha, beta] = e^{-P} [g / d, -y g / d]: scale S_ and mantissas Al, Be per row.
        G = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        Al = G / tl.load(d_ptr + offs, mask=mask, other=1.0)
        Be = -tl.load(y32_ptr + offs, mask=mask, other=0.0) * Al
        S_ = -tl.load(P_ptr + offs, mask=mask, other=0.0)
        for jj in tl.static_range(BLOCK_T):
            j = BLOCK_T - 1 - jj  # constexpr: rows walked right to left
            valid = tile * BLOCK_T + j < T
            h2, Ra2, Rb2, Sa2, Sb2 = _push_grad(
                h, Ra, Rb, Sa, Sb, w, _row(S_, rows, j), _row(Al, rows, j), _row(Be, rows, j)
            )
            h = tl.where(valid, h2, h)
            Ra = tl.where(valid, Ra2, Ra)
            Rb = tl.where(valid, Rb2, Rb)
            Sa = tl.where(valid, Sa2, Sa)
            Sb = tl.where(valid, Sb2, Sb)
    tl.debug_barrier()

    # Left-to-right sweep: per tile, the right carries (and the bonus term) right to left, then the left ones.
    hL = tl.full([BLOCK_C], _NEG, tl.float32)
    La = tl.zeros([BLOCK_C], tl.float32)
    Lb = tl.zeros([BLOCK_C], tl.float32)
    Ma = tl.zeros([BLOCK_C], tl.float32)  # L'[alpha]
    Mb = tl.zeros([BLOCK_C], tl.float32)  # L'[beta]
    du = tl.zeros([BLOCK_C], tl.float32)
    dw = tl.zeros([BLOCK_C], tl.float32)
    for tile in range(n_tiles):
        t = tile * BLOCK_T + rows
        offs = seq + t[:, None] * C + cols[None, :]
        mask = (t < T)[:, None] & col_ok[None, :]
        K = tl.load(k_ptr + offs, mask=mask, other=_NEG).to(tl.float32)
        V = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        G = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        Al = G / tl.load(d_ptr + offs, mask=mask, other=1.0)
        Be = -tl.load(y32_ptr + offs, mask=mask, other=0.0) * Al
        S_ = -tl.load(P_ptr + offs, mask=mask, other=0.0)
        h = tl.load(carry_row + tile * C, mask=col_ok, other=_NEG)
        Ra = tl.load(carry_row + tile * C + field, mask=col_ok, other=0.0)
        Rb = tl.load(carry_row + tile * C + 2 * field, mask=col_ok, other=0.0)
        Sa = tl.load(carry_row + tile * C + 3 * field, mask=col_ok, other=0.0)
        Sb = tl.load(carry_row + tile * C + 4 * field, mask=col_ok, other=0.0)

        # Bonus term and everything from the right. Masked rows have k = _NEG: their e^k terms vanish.
        dK = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        dV = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for jj in tl.static_range(BLOCK_T):
            j = BLOCK_T - 1 - jj  # constexpr: rows walked right to left
            k_j = _row(K, rows, j)
            v_j = _row(V, rows, j)
            s_j = _row(S_, rows, j)
            a_j = _row(Al, rows, j)
            b_j = _row(Be, rows, j)
            # e^{u + k_j} [alpha_j, beta_j]: the attention weight of token j on itself times g_j.
            e_self = tl.exp((k_j + s_j) + u)
            # e^{k_j} times the right carries: weights K(t, j) e^{k_j} / D_t <= 1, never overflows.
            e_right = tl.exp(k_j + h)
            dk_self = e_self * (v_j * a_j + b_j)
            du += dk_self
            dw -= e_right * (v_j * Sa + Sb)
            dK = _put(dK, rows, j, dk_self + e_right * (v_j * Ra + Rb))
            dV = _put(dV, rows, j, e_self * a_j + e_right * Ra)
            valid = tile * BLOCK_T + j < T
            h2, Ra2, Rb2, Sa2, Sb2 = _push_grad(h, Ra, Rb, Sa, Sb, w, s_j, a_j, b_j)
            h = tl.where(valid, h2, h)
            Ra = tl.where(valid, Ra2, Ra)
            Rb = tl.where(valid, Rb2, Rb)
            Sa = tl.where(valid, Sa2, Sa)
            Sb = tl.where(valid, Sb2, Sb)

        # Everything from the left, with the running left carries.
        for j in tl.static_range(BLOCK_T):
            k_j = _row(K, rows, j)
            v_j = _row(V, rows, j)
            e_left = tl.exp(k_j + hL)
            dw -= e_left * (v_j * Ma + Mb)
            dK = _put(dK, rows, j, _row(dK, rows, j) + e_left * (v_j * La + Lb))
            dV = _put(dV, rows, j, _row(dV, rows, j) + e_left * La)
            # Rows past T only follow the last real one, so the left carries need no mask.
            hL, La, Lb, Ma, Mb = _push_grad(
                hL, La, Lb, Ma, Mb, w, _row(S_, rows, j), _row(Al, rows, j), _row(Be, rows, j)
            )

        tl.store(dk_ptr + offs, dK.to(dk_ptr.dtype.element_ty), mask=mask)
        tl.store(dv_ptr + offs, dV.to(dv_ptr.dtype.element_ty), mask=mask)

    # Per-sequence partial sums; the wrapper adds them over the batch (deterministic, no atomics).
    tl.store(du_ptr + b * C + cols, du, mask=col_ok)
    tl.store(dw_ptr + b * C + cols, dw, mask=col_ok)


class _BiWKVTriton(torch.autograd.Function):
    """Bi-WKV through the kernels above; saves y (fp32) and D = e^P d for the backward, O(B T C)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        B, T, C = k.shape
        # Forward runs under no_grad; what the backward will need is in needs_input_grad.
        save = any(ctx.needs_input_grad)
        n_tiles = triton.cdiv(T, BLOCK_T)
        y = torch.empty_like(k)
        f32 = dict(device=k.device, dtype=torch.float32)
        # The backward needs y in fp32; for fp32 inputs that is y itself.
        y32 = y if (k.dtype == torch.float32 or not save) else torch.empty(B, T, C, **f32)
        P = torch.empty(B, T, C, **f32) if save else y32
        d = torch.empty(B, T, C, **f32) if save else y32
        carry = torch.empty(3, B, n_tiles, C, **f32)
        grid = (B, triton.cdiv(C, BLOCK_C))
        _bi_wkv_fwd_kernel[grid](
            w, u, k, v, y, y32, P, d, carry, B, T, C, n_tiles,
            BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, STORE_Y32=y32 is not y, SAVE=save, num_warps=NUM_WARPS,
        )
        if save:
            ctx.save_for_backward(w, u, k, v, y32, P, d)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        w, u, k, v, y32, P, d = ctx.saved_tensors
        B, T, C = k.shape
        n_tiles = triton.cdiv(T, BLOCK_T)
        grad_y = grad_y.contiguous()
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        f32 = dict(device=k.device, dtype=torch.float32)
        du, dw = torch.empty(B, C, **f32), torch.empty(B, C, **f32)
        carry = torch.empty(5, B, n_tiles, C, **f32)
        grid = (B, triton.cdiv(C, BLOCK_C))
        _bi_wkv_bwd_kernel[grid](
            w, u, k, v, grad_y, y32, P, d, dk, dv, du, dw, carry, B, T, C, n_tiles,
            BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
        )
        return dw.sum(0).to(w.dtype), du.sum(0).to(u.dtype), dk, dv


def bi_wkv_triton(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bi-WKV of k, v (B, T, C) with decay w and bonus u (C,) through the Triton kernels; returns (B, T, C).

    Same contract as backbones.ops.wkv.bi_wkv: computed in fp32, returned in promote(k, v) dtype (bf16 in,
    bf16 out). fp32, bf16 and fp16 inputs; float64 is refused (the kernels accumulate in fp32).
    """
    dtype = torch.promote_types(k.dtype, v.dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"bi_wkv_triton takes fp32, bf16 or fp16 k and v, got {dtype}; use backend='torch'.")
    B, T, C = k.shape
    if k.numel() == 0:
        return torch.zeros(B, T, C, device=k.device, dtype=dtype) + 0 * (w.sum() + u.sum() + k.sum() + v.sum())
    # k and v are read in their own dtype (no fp32 copy in memory); w, u are C floats.
    return _BiWKVTriton.apply(
        w.float().contiguous(), u.float().contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous()
    )
