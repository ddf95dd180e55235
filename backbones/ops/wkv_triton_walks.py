"""Device functions of the Bi-WKV kernels (backbones/ops/wkv_triton.py, whose docstring explains the scheme):
the walks along a chunk of tokens held as a (CHUNK, BLOCK_C) tile, and the loads that place a program's chunk.

A carry is (integer log-scale h, mantissas): the value is e^h times the mantissas. Every push takes exp of a
difference that is exact in fp32 (h - h_new is an integer, and h_new is within 0.5 of the largest term), which
is why the walks, not a log-sum-exp over rows, compute every sum here.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Log-scale of an empty carry: finite, so that differences of scales never give inf - inf.
_NEG = tl.constexpr(-1.0e30)
# Integer arguments the JIT must not specialise. At launch Triton marks every integer divisible by 16 (C = 384,
# T = 256, ...) as such, which lets it vectorise the (16, BLOCK_C) loads along channels (8 bf16 or 4 fp32 per
# thread): a chunk's 16 rows then spread over 8 or 4 lanes and every row pick becomes shuffles and barriers (sm_90,
# bf16 `_bwd_kernel`: 3,648 shuffles and 241 barriers at B64 T256 C384, against 0 and 0 with these left as plain
# integers; `train.bench.kernel_compile` builds the kernels as launched). They only feed masks and addresses.
_SHAPE_ARGS = ["B", "T", "C", "n_chunks"]
# Every walk over a chunk's 16 rows is written as _PARTS = 8 unrolled copies of a 2-step loop, not as 16 unrolled
# steps. Why: Triton's Coalesce pass costs about (memory ops) x (ops)^2 on a kernel whose ops all connect, and with 16
# unrolled steps the backward took 15 s per autotune config to compile, 12 s of it in that pass
# (`train.bench.kernel_compile`; the first H100 run spent its minutes in these compiles). LLVM unrolls the 2-step
# loops after that pass and folds every row pick to a register move: for sm_90 the SASS has the instructions,
# exponentials and selects of the fully unrolled walk. With 4-step loops the fp32 backward spilled under Triton 3.8;
# with 8-step loops LLVM left some rolled, and a rolled pick costs 16 selects.
_PARTS = tl.constexpr(8)


@triton.jit
def _row(tile, rows, j):
    """Row j of a (rows, BLOCK_C) tile as a (BLOCK_C,) vector (a register pick when rows live in-thread and j is
    known once the walk is unrolled; see _PARTS)."""
    return tl.sum(tl.where(rows[:, None] == j, tile, 0.0), axis=0)


@triton.jit
def _put(tile, rows, j, row):
    """The tile with row j replaced by `row`."""
    return tl.where(rows[:, None] == j, row[None, :], tile)


@triton.jit
def _push(h, A, D, decay, s, a, d):
    """Carry e^h [A, D] -> e^{-decay} carry + e^s [a, d]; the new scale is an integer (module docstring)."""
    h_new = tl.floor(tl.maximum(h - decay, s) + 0.5)
    # The exponent is <= 0.5 by the choice of h_new; the cap only matters for two empty scales (_NEG absorbs
    # the decay), whose mantissas are 0 and must stay finite.
    f = tl.exp(tl.minimum((h - h_new) - decay, 1.0))
    g = tl.exp(s - h_new)
    return h_new, A * f + g * a, D * f + g * d


@triton.jit
def _push_grad(h, Ra, Rb, Sa, Sb, decay, span, s, a, b, sa, sb):
    """Backward carries e^h [Ra, Rb] (R) and e^h [Sa, Sb] (R', distance-weighted) moved by `span` tokens
    (decay = span w), then e^s [a, b] and e^s [sa, sb] added: R' <- e^{-decay} (R' + span R) + ...,
    R <- e^{-decay} R + .... One token is span 1 with sa = sb = 0."""
    h_new = tl.floor(tl.maximum(h - decay, s) + 0.5)
    f = tl.exp(tl.minimum((h - h_new) - decay, 1.0))  # capped as in _push
    g = tl.exp(s - h_new)
    return h_new, Ra * f + g * a, Rb * f + g * b, (Sa + span * Ra) * f + g * sa, (Sb + span * Rb) * f + g * sb


@triton.jit
def _chunk_sums(K, V, rows, w, t0, T, BLOCK_T: tl.constexpr):
    """A chunk's two aggregates [scale, num, den]: as the next chunk's first token sees it (left, a walk left to
    right) and as the previous chunk's last token sees it (right, a walk right to left). A walk, not a log-sum-exp
    of k_j - j w over the rows: rounding j w (up to 15 w) costs ulp(j w) in every weight, 1e-5 once |w| is 10,
    while each step of a walk takes exp of a difference that is exact."""
    hL = tl.full([K.shape[1]], _NEG, tl.float32)
    AL = tl.zeros([K.shape[1]], tl.float32)
    DL = tl.zeros([K.shape[1]], tl.float32)
    hR = tl.full([K.shape[1]], _NEG, tl.float32)
    AR = tl.zeros([K.shape[1]], tl.float32)
    DR = tl.zeros([K.shape[1]], tl.float32)
    for part in tl.static_range(_PARTS):
        for step in range(BLOCK_T // _PARTS):
            jj = part * (BLOCK_T // _PARTS) + step
            # Padding rows past T end the left walk (the last chunk's left sums are never used) and must not
            # enter the right one.
            hL, AL, DL = _push(hL, AL, DL, w, _row(K, rows, jj), _row(V, rows, jj), 1.0)
            j = BLOCK_T - 1 - jj  # rows walked right to left
            h2, A2, D2 = _push(hR, AR, DR, w, _row(K, rows, j), _row(V, rows, j), 1.0)
            valid = t0 + j < T
            hR = tl.where(valid, h2, hR)
            AR = tl.where(valid, A2, AR)
            DR = tl.where(valid, D2, DR)
    return hL, AL, DL, hR, AR, DR


@triton.jit
def _chunk_sums_grad(S_, Al, Be, rows, w, t0, T, BLOCK_T: tl.constexpr):
    """The backward's two aggregates [scale, R_a, R_b, R'_a, R'_b] of a chunk, walked as in _chunk_sums."""
    hL = tl.full([S_.shape[1]], _NEG, tl.float32)
    La = tl.zeros([S_.shape[1]], tl.float32)
    Lb = tl.zeros([S_.shape[1]], tl.float32)
    Ma = tl.zeros([S_.shape[1]], tl.float32)
    Mb = tl.zeros([S_.shape[1]], tl.float32)
    hR = tl.full([S_.shape[1]], _NEG, tl.float32)
    Ra = tl.zeros([S_.shape[1]], tl.float32)
    Rb = tl.zeros([S_.shape[1]], tl.float32)
    Sa = tl.zeros([S_.shape[1]], tl.float32)
    Sb = tl.zeros([S_.shape[1]], tl.float32)
    for part in tl.static_range(_PARTS):
        for step in range(BLOCK_T // _PARTS):
            jj = part * (BLOCK_T // _PARTS) + step
            hL, La, Lb, Ma, Mb = _push_grad(hL, La, Lb, Ma, Mb, w, 1.0, _row(S_, rows, jj), _row(Al, rows, jj),
                                            _row(Be, rows, jj), 0.0, 0.0)
            j = BLOCK_T - 1 - jj  # rows walked right to left
            h2, Ra2, Rb2, Sa2, Sb2 = _push_grad(hR, Ra, Rb, Sa, Sb, w, 1.0, _row(S_, rows, j), _row(Al, rows, j),
                                                _row(Be, rows, j), 0.0, 0.0)
            valid = t0 + j < T
            hR = tl.where(valid, h2, hR)
            Ra = tl.where(valid, Ra2, Ra)
            Rb = tl.where(valid, Rb2, Rb)
            Sa = tl.where(valid, Sa2, Sa)
            Sb = tl.where(valid, Sb2, Sb)
    return hL, La, Lb, Ma, Mb, hR, Ra, Rb, Sa, Sb


@triton.jit
def _fwd_tile(K, V, rows, w, u, hG, AG, DG, hH, AH, DH, t0, T, BLOCK_T: tl.constexpr):
    """One chunk's outputs from its rows and carries: y, and the denominator as scale P and mantissa d.
    G enters from the left (at the chunk's first token), H from the right (at its last)."""
    # Right to left: Z_t = e^{u + k_t} [v_t, 1] + H_t, as integer scale Zh and mantissas Zn, Zd per row.
    Zh = tl.zeros_like(K)
    Zn = tl.zeros_like(K)
    Zd = tl.zeros_like(K)
    for part in tl.static_range(_PARTS):
        for step in range(BLOCK_T // _PARTS):
            jj = part * (BLOCK_T // _PARTS) + step
            j = BLOCK_T - 1 - jj  # rows walked right to left
            k_j = _row(K, rows, j)
            v_j = _row(V, rows, j)
            m = tl.floor(tl.maximum(hH, k_j + u) + 0.5)
            e_carry = tl.exp(hH - m)
            e_self = tl.exp((k_j - m) + u)
            Zh = _put(Zh, rows, j, m)
            Zn = _put(Zn, rows, j, AH * e_carry + v_j * e_self)
            Zd = _put(Zd, rows, j, DH * e_carry + e_self)
            # Padding rows past T come first from the right: they must leave the carry empty.
            valid = t0 + j < T
            h2, A2, D2 = _push(hH, AH, DH, w, k_j, v_j, 1.0)
            hH = tl.where(valid, h2, hH)
            AH = tl.where(valid, A2, AH)
            DH = tl.where(valid, D2, DH)
    # Left to right: y_t = (G_t + Z_t) under the common integer scale P_t = max(h_G, h_Z).
    Y = tl.zeros_like(K)
    Pt = tl.zeros_like(K)
    Dt = tl.zeros_like(K)
    for part in tl.static_range(_PARTS):
        for step in range(BLOCK_T // _PARTS):
            j = part * (BLOCK_T // _PARTS) + step
            m = _row(Zh, rows, j)
            P = tl.maximum(hG, m)
            e_left = tl.exp(hG - P)
            e_z = tl.exp(m - P)
            num = AG * e_left + _row(Zn, rows, j) * e_z
            den = DG * e_left + _row(Zd, rows, j) * e_z
            Y = _put(Y, rows, j, num / den)
            Pt = _put(Pt, rows, j, P)
            Dt = _put(Dt, rows, j, den)
            # Rows past T only follow the last real one, so the left carry needs no mask.
            hG, AG, DG = _push(hG, AG, DG, w, _row(K, rows, j), _row(V, rows, j), 1.0)
    return Y, Pt, Dt


@triton.jit
def _tile(k_ptr, v_ptr, b, T, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Offsets, mask and the fp32 k (padding _NEG), v (padding 0) tiles of this program's chunk."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = (t < T)[:, None] & (cols < C)[None, :]
    offs = b.to(tl.int64) * T * C + t[:, None] * C + cols[None, :]
    K = tl.load(k_ptr + offs, mask=mask, other=_NEG).to(tl.float32)
    V = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return offs, mask, K, V


@triton.jit
def _slot(b, n_chunks, C, BLOCK_C: tl.constexpr):
    """Offset of this program's (sequence, chunk, channels) in a (fields, B, n_chunks, C) scratch, and col mask."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return (b * n_chunks + tl.program_id(2)) * C + cols, cols < C


@triton.jit
def _load_fwd_carries(carry_ptr, slot, col_ok, field):
    hG = tl.load(carry_ptr + slot, mask=col_ok, other=_NEG)
    AG = tl.load(carry_ptr + slot + field, mask=col_ok, other=0.0)
    DG = tl.load(carry_ptr + slot + 2 * field, mask=col_ok, other=0.0)
    hH = tl.load(carry_ptr + slot + 3 * field, mask=col_ok, other=_NEG)
    AH = tl.load(carry_ptr + slot + 4 * field, mask=col_ok, other=0.0)
    DH = tl.load(carry_ptr + slot + 5 * field, mask=col_ok, other=0.0)
    return hG, AG, DG, hH, AH, DH


@triton.jit
def _cols(BLOCK_C: tl.constexpr):
    return tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)


@triton.jit
def _alpha_beta(gy_ptr, offs, mask, Y, Pt, Dt):
    """[alpha, beta] = e^{-P} [g / d, -y g / d] of the recomputed forward: scale and two mantissa tiles."""
    Al = tl.where(mask, tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32) / tl.where(mask, Dt, 1.0), 0.0)
    # Padding rows' y is inf / inf = nan once u >= 88 (their k is _NEG, so their scale is e^u): masked, not
    # multiplied by zero.
    return tl.where(mask, -Pt, _NEG), Al, tl.where(mask, -Y * Al, 0.0)


@triton.jit
def _bwd_tile(K, V, S_, Al, Be, rows, w, u, h, Ra, Rb, Sa, Sb, left_ptr, left_ok, field, t0, T,
              BLOCK_T: tl.constexpr, dk_ptr, dv_ptr, C, col_ok, STORE_ROWS: tl.constexpr):
    """One chunk's dk, dv tiles and its du, dw sums from its rows, [alpha, beta] (scale S_, mantissas Al, Be) and
    the backward carries entering it: e^h [Ra, Rb], e^h [Sa, Sb] (R, R') from the right, and from the left e^hL [La,
    Lb], e^hL [Ma, Mb] (L, L'), five fields at left_ptr (per column, masked by left_ok), loaded between the walks so
    that they take no registers during the first (backbones/ops/wkv_triton.py, "Backward").
    STORE_ROWS: each row of dk, dv is stored where the second walk completes it, at dk_ptr + row C + column (the
    pointers per column; rows past T and columns outside col_ok masked), so no tile of
    offsets and predicates is held through the walks (wkv_triton_fused); the tiles returned are then partial."""
    # Bonus term and everything from the right. Padding rows have k = _NEG: their e^k terms vanish.
    du = tl.zeros([K.shape[1]], tl.float32)
    dw = tl.zeros([K.shape[1]], tl.float32)
    dK = tl.zeros_like(K)
    dV = tl.zeros_like(K)
    for part in tl.static_range(_PARTS):
        for step in range(BLOCK_T // _PARTS):
            jj = part * (BLOCK_T // _PARTS) + step
            j = BLOCK_T - 1 - jj  # rows walked right to left
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
            valid = t0 + j < T
            h2, Ra2, Rb2, Sa2, Sb2 = _push_grad(h, Ra, Rb, Sa, Sb, w, 1.0, s_j, a_j, b_j, 0.0, 0.0)
            h = tl.where(valid, h2, h)
            Ra = tl.where(valid, Ra2, Ra)
            Rb = tl.where(valid, Rb2, Rb)
            Sa = tl.where(valid, Sa2, Sa)
            Sb = tl.where(valid, Sb2, Sb)

    # Everything from the left, from the carries entering the chunk.
    hL, La, Lb, Ma, Mb = _load_bwd_carries(left_ptr, 0, left_ok, field)
    for part in tl.static_range(_PARTS):
        for step in range(BLOCK_T // _PARTS):
            j = part * (BLOCK_T // _PARTS) + step
            k_j = _row(K, rows, j)
            v_j = _row(V, rows, j)
            e_left = tl.exp(k_j + hL)
            dw -= e_left * (v_j * Ma + Mb)
            dk_j = _row(dK, rows, j) + e_left * (v_j * La + Lb)
            dv_j = _row(dV, rows, j) + e_left * La
            if STORE_ROWS:
                row_ok = (t0 + j < T) & col_ok
                tl.store(dk_ptr + j * C, dk_j.to(dk_ptr.dtype.element_ty), mask=row_ok)
                tl.store(dv_ptr + j * C, dv_j.to(dv_ptr.dtype.element_ty), mask=row_ok)
            else:
                dK = _put(dK, rows, j, dk_j)
                dV = _put(dV, rows, j, dv_j)
            # Rows past T only follow the last real one, so the left carries need no mask.
            hL, La, Lb, Ma, Mb = _push_grad(hL, La, Lb, Ma, Mb, w, 1.0, _row(S_, rows, j), _row(Al, rows, j),
                                            _row(Be, rows, j), 0.0, 0.0)
    return dK, dV, du, dw


@triton.jit
def _load_bwd_carries(carry_ptr, slot, col_ok, field):
    """One side's backward carry [scale, R_a, R_b, R'_a, R'_b] from five fields of a chunk scratch."""
    h = tl.load(carry_ptr + slot, mask=col_ok, other=_NEG)
    Ra = tl.load(carry_ptr + slot + field, mask=col_ok, other=0.0)
    Rb = tl.load(carry_ptr + slot + 2 * field, mask=col_ok, other=0.0)
    Sa = tl.load(carry_ptr + slot + 3 * field, mask=col_ok, other=0.0)
    Sb = tl.load(carry_ptr + slot + 4 * field, mask=col_ok, other=0.0)
    return h, Ra, Rb, Sa, Sb
