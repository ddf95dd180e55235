"""Bi-WKV as one Triton launch per pass (`TREAD_WKV_KERNEL=fused`): the chunk scheme of backbones/ops/wkv_triton.py
(16-token chunks, the same walks, the same log-scale carries, the same saved state) with the three launches per pass
(sums -> combine -> main) folded into one program per (sequence, BLOCK_C channels).

Layout. A program holds a segment of CHUNKS chunks as one (16, CHUNKS * BLOCK_C) tile: column c * BLOCK_C + j is
channel j of chunk c, so with BLOCK_C = 32 and CHUNKS warps a warp owns a chunk, a lane a channel, and a thread the
16 rows of its (chunk, channel) in registers: the layout of the 3-launch kernels, whose walks
(backbones/ops/wkv_triton_walks.py) run here unchanged, one chunk per warp, all at once.

The carries entering each chunk. The chunk aggregates of a segment are (CHUNKS, BLOCK_C) values, a chunk per warp;
the carry entering chunk c is the composition of the aggregates before it (from the left, or after it from the
right), each moved across the chunks that follow: X1 then X2 = e^{-16 w m2} X1 + X2 for an X2 spanning m2 chunks.
That composition is associative, so `tl.associative_scan` runs it along the chunk axis (across warps; Triton moves
the partials through shared memory). The scan is inclusive; the exclusive one (what enters a chunk, not what leaves
it) comes from scanning pairs (P, L): P the chunk's own composition, L what precedes it inside the pair's span, a
leaf being (aggregate, empty), and (P1, L1) then (P2, L2) = (P1 then P2, P1 then L2). The carry from earlier
segments enters as the first leaf's L.

Numerics as in the 3-launch kernels: every carry is (integer log-scale h, mantissas), and moving one by m chunks
takes exp of (h_old - h_new) - m (16 w) as one fused multiply-add of exact operands (h_old - h_new is an integer,
16 w is exact, m a small integer): one rounding, like the combine walk's step, whatever m is. No exponent of an
unbounded quantity is taken; empty carries are the finite _NEG.

Segments. A sequence longer than a segment (16 CHUNKS tokens; 64 at the shipped config, so 4 segments at T = 256
and 256 at T = 16,384) is walked segment by segment, in one launch. The carry leaving a segment goes to the next
through a small (fields, B, C) buffer between two barriers (held in registers across the loop it cost the backward
5 of the registers it did not have); every other value a thread reads back it wrote itself.
- forward: right to left, each chunk's two aggregates (the left ones into a scratch) and the right carries by a
  scan, into the saved state; then left to right, the left carries by a scan of the stored aggregates, into the saved
  state, and y from both. The state is the 3-launch kernels' (6, B, n, C) chunk carries, so either backward takes
  either forward's state.
- backward: the same two passes over [alpha, beta], each recomputing the forward tile from the saved carries. The
  second runs its scan before recomputing the tile, and `_bwd_tile` reads the left carries back from the scratch
  between its walks and stores dk, dv row by row: none of them is then held beside the walks' seven tiles (each
  did cost spills on sm_90: `train.bench.kernel_compile`). du and dw leave per chunk, added on the host.

Cost against the 3-launch path: the same walks per chunk (forward 4, backward 8) plus the scans, the tiles read
once per direction, half the chunk scratch, 2 launches instead of 7 (`traffic` below; docs/rwkv.md, "One launch per
pass", for the counts and the estimate). Parallelism is B x C / 32 programs: 768 at B64 T256 C384, but 12 at B1
T16384 C384, where the 3-launch kernels' chunk programs win.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from backbones.ops.op_inputs import OpInputError
from backbones.ops.triton_launch import launch
from backbones.ops.wkv_triton_walks import (
    _NEG,
    _SHAPE_ARGS,
    _alpha_beta,
    _bwd_tile,
    _chunk_sums,
    _chunk_sums_grad,
    _fwd_tile,
    _load_bwd_carries,
    _load_fwd_carries,
)


def _configs() -> list[triton.Config]:
    """Channels per program and chunks per segment (a warp per chunk: num_warps = CHUNKS). Under TRITON_INTERPRET=1
    2-chunk segments, so that the tests' sequences cross segment boundaries."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BLOCK_C": 32, "CHUNKS": 2}, num_warps=2)]
    # One config: the backward holds seven (16-row) tiles a thread, so about 240 registers whatever the segment, and
    # the register file fits 8 such warps per SM: two programs of 4 warps or one of 8 run at once either way, and 4
    # keeps the CTA's scans and cross-warp picks short (`train.bench.kernel_compile`).
    return [triton.Config({"BLOCK_C": 32, "CHUNKS": 4}, num_warps=4)]


@triton.jit
def _segment(k_ptr, v_ptr, b, seg, T, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """Rows, offsets, mask, the first token of each column's chunk (t0), the channel and the fp32 k (padding _NEG),
    v (padding 0) tiles of one segment as a (BLOCK_T, CHUNKS BLOCK_C) tile: column c BLOCK_C + j is channel j of the
    segment's chunk c. The offsets are int32 within sequence b (k_ptr, v_ptr point at its start): half the
    registers of int64 ones, which the backward needs (T C < 2^31, checked by the caller)."""
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, CHUNKS * BLOCK_C)
    ch = tl.program_id(1) * BLOCK_C + cols % BLOCK_C
    t0 = seg * (CHUNKS * BLOCK_T) + (cols // BLOCK_C) * BLOCK_T
    # A per-thread column term and a per-row constant (rows are constants once the walks are unrolled), as the
    # 3-launch kernels' uniform rows give: a (16, .) tile of per-element offsets and predicates held through the
    # backward's walks costs registers it does not have.
    offs = rows[:, None] * C + (t0 * C + ch)[None, :]  # (BLOCK_T, CHUNKS BLOCK_C)
    mask = (rows[:, None] < (T - t0)[None, :]) & (ch < C)[None, :]
    K = tl.load(k_ptr + offs, mask=mask, other=_NEG).to(tl.float32)
    V = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return rows, offs, mask, t0, ch, K, V


@triton.jit
def _slots(b, seg, n_chunks, C, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """Each column's offset in a (fields, B, n_chunks, C) chunk scratch, and whether the slot exists."""
    cols = tl.arange(0, CHUNKS * BLOCK_C)
    ch = tl.program_id(1) * BLOCK_C + cols % BLOCK_C
    chunk = seg * CHUNKS + cols // BLOCK_C
    return (b * n_chunks + chunk) * C + ch, (chunk < n_chunks) & (ch < C)


@triton.jit
def _move(h1, h2, m2, W):
    """Scale and factors f, g of e^{-m2 W} e^{h1} [A1, D1] + e^{h2} [...]: the carry e^h1 moved across m2 chunks of
    decay W = 16 w each; the new scale an integer, the move's exponent one rounding (module docstring)."""
    h = tl.floor(tl.maximum(h1 - m2 * W, h2) + 0.5)
    # Capped as in wkv_triton_walks._push: the cap matters only for two empty scales, whose mantissas are 0.
    f = tl.exp(tl.minimum(tl.fma(-m2, W, h1 - h), 1.0))
    return h, f, tl.exp(h2 - h)


@triton.jit
def _then(h1, A1, D1, m1, h2, A2, D2, m2, W):
    """Forward carry X1 = e^h1 [A1, D1] spanning m1 chunks, then X2 spanning m2."""
    h, f, g = _move(h1, h2, m2, W)
    return h, A1 * f + g * A2, D1 * f + g * D2, m1 + m2


@triton.jit
def _then_grad(h1, Ra1, Rb1, Sa1, Sb1, m1, h2, Ra2, Rb2, Sa2, Sb2, m2, W, BLOCK_T: tl.constexpr):
    """Backward carry X1 = e^h1 [R_a, R_b, R'_a, R'_b] spanning m1 chunks, then X2 spanning m2: R' moved by s
    tokens is e^{-s w} (R' + s R) (wkv_triton_walks._push_grad), here s = 16 m2."""
    h, f, g = _move(h1, h2, m2, W)
    span = m2 * BLOCK_T
    Sa = (Sa1 + span * Ra1) * f + g * Sa2
    Sb = (Sb1 + span * Rb1) * f + g * Sb2
    return h, Ra1 * f + g * Ra2, Rb1 * f + g * Rb2, Sa, Sb, m1 + m2


@triton.jit
def _pair(Ph1, PA1, PD1, Pm1, Lh1, LA1, LD1, W1, Ph2, PA2, PD2, Pm2, Lh2, LA2, LD2, W2):
    """Scan operator of the forward's (P, L) pairs: (P1 then P2, P1 then L2); P spans Pm chunks, L one fewer; W
    rides along (one per channel)."""
    Ph, PA, PD, Pm = _then(Ph1, PA1, PD1, Pm1, Ph2, PA2, PD2, Pm2, W1)
    Lh, LA, LD, _ = _then(Ph1, PA1, PD1, Pm1, Lh2, LA2, LD2, Pm2 - 1.0, W1)
    return Ph, PA, PD, Pm, Lh, LA, LD, W1


@triton.jit
def _pair_grad(Ph1, PA1, PB1, PS1, PT1, Pm1, Lh1, LA1, LB1, LS1, LT1, W1,
               Ph2, PA2, PB2, PS2, PT2, Pm2, Lh2, LA2, LB2, LS2, LT2, W2):
    """Scan operator of the backward's (P, L) pairs, as _pair."""
    P = _then_grad(Ph1, PA1, PB1, PS1, PT1, Pm1, Ph2, PA2, PB2, PS2, PT2, Pm2, W1, 16)
    L = _then_grad(Ph1, PA1, PB1, PS1, PT1, Pm1, Lh2, LA2, LB2, LS2, LT2, Pm2 - 1.0, W1, 16)
    return P[0], P[1], P[2], P[3], P[4], P[5], L[0], L[1], L[2], L[3], L[4], W1


@triton.jit
def _by_chunk(x, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """A (CHUNKS BLOCK_C,) column vector as (CHUNKS, BLOCK_C): chunk by channel (the same registers)."""
    return tl.reshape(x, (CHUNKS, BLOCK_C))


@triton.jit
def _columns(x, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """A (CHUNKS, BLOCK_C) tensor as (CHUNKS BLOCK_C,) columns (the same registers)."""
    return tl.reshape(x, (CHUNKS * BLOCK_C,))


@triton.jit
def _scan_carries(hs, As, Ds, hc, Ac, Dc, W, REVERSE: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """Forward carries entering each chunk of a segment (L) and leaving it (P), as columns, from its chunk aggregates
    e^hs [As, Ds] and the carry e^hc [Ac, Dc] entering the segment (read at the first chunk's columns only), scanned
    left to right (REVERSE: right to left)."""
    first = tl.arange(0, CHUNKS)[:, None] == REVERSE * (CHUNKS - 1)  # the chunk the scan starts from
    one = tl.zeros([CHUNKS, BLOCK_C], tl.float32) + 1.0
    g = (_by_chunk(hs, BLOCK_C, CHUNKS), _by_chunk(As, BLOCK_C, CHUNKS), _by_chunk(Ds, BLOCK_C, CHUNKS))
    c = (_by_chunk(hc, BLOCK_C, CHUNKS), _by_chunk(Ac, BLOCK_C, CHUNKS), _by_chunk(Dc, BLOCK_C, CHUNKS))
    # Leaves: P the chunk's aggregate (behind the incoming carry at the first chunk), L empty (the carry itself).
    h0 = _then(c[0], c[1], c[2], one - 1.0, g[0], g[1], g[2], one, W)
    Ph, PA, PD, _, Lh, LA, LD, _ = tl.associative_scan(
        (tl.where(first, h0[0], g[0]), tl.where(first, h0[1], g[1]), tl.where(first, h0[2], g[2]), one,
         tl.where(first, c[0], _NEG), tl.where(first, c[1], 0.0), tl.where(first, c[2], 0.0), W), 0, _pair,
        reverse=REVERSE)
    return (_columns(Lh, BLOCK_C, CHUNKS), _columns(LA, BLOCK_C, CHUNKS), _columns(LD, BLOCK_C, CHUNKS),
            _columns(Ph, BLOCK_C, CHUNKS), _columns(PA, BLOCK_C, CHUNKS), _columns(PD, BLOCK_C, CHUNKS))


@triton.jit
def _scan_carries_grad(hs, As, Bs, Ss, Ts, hc, Ac, Bc, Sc, Tc, W, REVERSE: tl.constexpr, BLOCK_C: tl.constexpr,
                       CHUNKS: tl.constexpr):
    """_scan_carries for the backward's carries [scale, R_a, R_b, R'_a, R'_b]."""
    first = tl.arange(0, CHUNKS)[:, None] == REVERSE * (CHUNKS - 1)  # the chunk the scan starts from
    one = tl.zeros([CHUNKS, BLOCK_C], tl.float32) + 1.0
    g = (_by_chunk(hs, BLOCK_C, CHUNKS), _by_chunk(As, BLOCK_C, CHUNKS), _by_chunk(Bs, BLOCK_C, CHUNKS),
         _by_chunk(Ss, BLOCK_C, CHUNKS), _by_chunk(Ts, BLOCK_C, CHUNKS))
    c = (_by_chunk(hc, BLOCK_C, CHUNKS), _by_chunk(Ac, BLOCK_C, CHUNKS), _by_chunk(Bc, BLOCK_C, CHUNKS),
         _by_chunk(Sc, BLOCK_C, CHUNKS), _by_chunk(Tc, BLOCK_C, CHUNKS))
    h0 = _then_grad(c[0], c[1], c[2], c[3], c[4], one - 1.0, g[0], g[1], g[2], g[3], g[4], one, W, 16)
    s = tl.associative_scan(
        (tl.where(first, h0[0], g[0]), tl.where(first, h0[1], g[1]), tl.where(first, h0[2], g[2]),
         tl.where(first, h0[3], g[3]), tl.where(first, h0[4], g[4]), one, tl.where(first, c[0], _NEG),
         tl.where(first, c[1], 0.0), tl.where(first, c[2], 0.0), tl.where(first, c[3], 0.0),
         tl.where(first, c[4], 0.0), W), 0, _pair_grad, reverse=REVERSE)
    return (_columns(s[6], BLOCK_C, CHUNKS), _columns(s[7], BLOCK_C, CHUNKS), _columns(s[8], BLOCK_C, CHUNKS),
            _columns(s[9], BLOCK_C, CHUNKS), _columns(s[10], BLOCK_C, CHUNKS), _columns(s[0], BLOCK_C, CHUNKS),
            _columns(s[1], BLOCK_C, CHUNKS), _columns(s[2], BLOCK_C, CHUNKS), _columns(s[3], BLOCK_C, CHUNKS),
            _columns(s[4], BLOCK_C, CHUNKS))


@triton.jit
def _handoff(b, seg, n_seg, C, REVERSE: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """The carry leaving a segment, handed to the next one through a (fields, B, C) buffer rather than held across
    the loop in registers (5 more in a backward at its limit): its offset per column, the columns that write it
    (those of the chunk the scan ends at) and those that read it in segment `seg` (the chunk the scan starts from;
    none in the first segment walked). A barrier separates the write from the next segment's read."""
    cols = tl.arange(0, CHUNKS * BLOCK_C)
    ch = tl.program_id(1) * BLOCK_C + cols % BLOCK_C
    chunk = cols // BLOCK_C
    read = (chunk == REVERSE * (CHUNKS - 1)) & (seg != (n_seg - 1) * REVERSE) & (ch < C)
    return b * C + ch, (chunk == (1 - REVERSE) * (CHUNKS - 1)) & (ch < C), read


@triton.jit
def _store_fields(ptr, slot, ok, field, x0, x1, x2):
    tl.store(ptr + slot, x0, mask=ok)
    tl.store(ptr + slot + field, x1, mask=ok)
    tl.store(ptr + slot + 2 * field, x2, mask=ok)


@triton.jit
def _store_grad_fields(ptr, slot, ok, field, x0, x1, x2, x3, x4):
    _store_fields(ptr, slot, ok, field, x0, x1, x2)
    tl.store(ptr + slot + 3 * field, x3, mask=ok)
    tl.store(ptr + slot + 4 * field, x4, mask=ok)


@triton.jit
def _program(w_ptr, u_ptr, B, T, C, n_chunks, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """What every program starts from: a scratch field's size, its segments, each column's channel, w and u by column,
    and the decay of a chunk W = 16 w as (CHUNKS, BLOCK_C)."""
    cols = tl.arange(0, CHUNKS * BLOCK_C)
    ch = tl.program_id(1) * BLOCK_C + cols % BLOCK_C
    w = tl.load(w_ptr + ch, mask=ch < C, other=0.0)
    u = tl.load(u_ptr + ch, mask=ch < C, other=0.0)
    return B * n_chunks * C, tl.cdiv(T, CHUNKS * BLOCK_T), ch, w, u, _by_chunk(BLOCK_T * w, BLOCK_C, CHUNKS)


@triton.autotune(configs=_configs(), key=["T", "C"])
@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _fused_fwd_kernel(w_ptr, u_ptr, k_ptr, v_ptr, carry_ptr, agg_ptr, hand_ptr, y_ptr, B, T, C, n_chunks,
                      BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """y and the (6, B, n, C) chunk carries [scale, num, den] from the left (fields 0-2) and the right (3-5); agg_ptr:
    a (3, B, n, C) scratch for the chunks' left aggregates, hand_ptr a (3, B, C) one for the carry between
    segments."""
    b = tl.program_id(0)
    seq = b.to(tl.int64) * T * C  # sequence b's first element: the tiles' offsets are int32 from there
    k_ptr += seq
    v_ptr += seq
    y_ptr += seq
    field, n_seg, ch, w, u, W = _program(w_ptr, u_ptr, B, T, C, n_chunks, BLOCK_T, BLOCK_C, CHUNKS)
    right = carry_ptr + 3 * field

    # Right to left: each chunk's aggregates (the left ones kept for the second pass), the right carries by a scan.
    for i in range(n_seg):
        seg = n_seg - 1 - i
        rows, offs, mask, t0, _, K, V = _segment(k_ptr, v_ptr, b, seg, T, C, BLOCK_T, BLOCK_C, CHUNKS)
        sums = _chunk_sums(K, V, rows, w, t0, T, BLOCK_T)
        slot, ok = _slots(b, seg, n_chunks, C, BLOCK_C, CHUNKS)
        _store_fields(agg_ptr, slot, ok, field, sums[0], sums[1], sums[2])
        hand, write, read = _handoff(b, seg, n_seg, C, True, BLOCK_C, CHUNKS)
        c = _load_fwd_carries(hand_ptr, hand, read, B * C)
        x = _scan_carries(sums[3], sums[4], sums[5], c[0], c[1], c[2], W, True, BLOCK_C, CHUNKS)
        _store_fields(right, slot, ok, field, x[0], x[1], x[2])
        tl.debug_barrier()  # every read of the buffer above is done
        _store_fields(hand_ptr, hand, write, B * C, x[3], x[4], x[5])
        tl.debug_barrier()  # the next segment's first chunk (another warp) reads it

    # Left to right: the left carries by a scan of the stored aggregates, then y from both sides.
    for seg in range(n_seg):
        slot, ok = _slots(b, seg, n_chunks, C, BLOCK_C, CHUNKS)
        hand, write, read = _handoff(b, seg, n_seg, C, False, BLOCK_C, CHUNKS)
        c = _load_fwd_carries(hand_ptr, hand, read, B * C)
        a = _load_fwd_carries(agg_ptr, slot, ok, field)
        x = _scan_carries(a[0], a[1], a[2], c[0], c[1], c[2], W, False, BLOCK_C, CHUNKS)
        _store_fields(carry_ptr, slot, ok, field, x[0], x[1], x[2])
        tl.debug_barrier()
        _store_fields(hand_ptr, hand, write, B * C, x[3], x[4], x[5])
        rows, offs, mask, t0, _, K, V = _segment(k_ptr, v_ptr, b, seg, T, C, BLOCK_T, BLOCK_C, CHUNKS)
        # This thread wrote these right carries itself in the first pass.
        Y, _, _ = _fwd_tile(K, V, rows, w, u, *_load_fwd_carries(carry_ptr, slot, ok, field), t0, T, BLOCK_T)
        tl.store(y_ptr + offs, Y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()


@triton.jit
def _recompute(k_ptr, v_ptr, gy_ptr, fcarry_ptr, b, seg, w, u, T, C, n_chunks, field, BLOCK_T: tl.constexpr,
               BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """A segment's tiles, its forward recomputed from the saved carries, and [alpha, beta] (wkv_triton_walks)."""
    rows, offs, mask, t0, _, K, V = _segment(k_ptr, v_ptr, b, seg, T, C, BLOCK_T, BLOCK_C, CHUNKS)
    slot, ok = _slots(b, seg, n_chunks, C, BLOCK_C, CHUNKS)
    carries = _load_fwd_carries(fcarry_ptr, slot, ok, field)
    Y, Pt, Dt = _fwd_tile(K, V, rows, w, u, *carries, t0, T, BLOCK_T)
    S_, Al, Be = _alpha_beta(gy_ptr, offs, mask, Y, Pt, Dt)
    return rows, offs, mask, t0, slot, ok, K, V, S_, Al, Be


@triton.autotune(configs=_configs(), key=["T", "C"])
@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _fused_bwd_kernel(w_ptr, u_ptr, k_ptr, v_ptr, gy_ptr, fcarry_ptr, bcarry_ptr, hand_ptr, dk_ptr, dv_ptr, part_ptr,
                      B, T, C, n_chunks, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """dk, dv and the (2, B, n, C) du, dw sums per chunk; bcarry_ptr: a (10, B, n, C) scratch, the right backward
    carries (fields 0-4) and the left aggregates, then carries (5-9) of every chunk; hand_ptr: (5, B, C), between
    segments."""
    b = tl.program_id(0)
    seq = b.to(tl.int64) * T * C  # sequence b's first element: the tiles' offsets are int32 from there
    k_ptr += seq
    v_ptr += seq
    gy_ptr += seq
    dk_ptr += seq
    dv_ptr += seq
    field, n_seg, ch, w, u, W = _program(w_ptr, u_ptr, B, T, C, n_chunks, BLOCK_T, BLOCK_C, CHUNKS)
    aggs = bcarry_ptr + 5 * field

    # Right to left: each chunk's backward aggregates (the left ones kept), the right carries by a scan.
    for i in range(n_seg):
        seg = n_seg - 1 - i
        rows, offs, mask, t0, slot, ok, K, V, S_, Al, Be = _recompute(
            k_ptr, v_ptr, gy_ptr, fcarry_ptr, b, seg, w, u, T, C, n_chunks, field, BLOCK_T, BLOCK_C, CHUNKS)
        s = _chunk_sums_grad(S_, Al, Be, rows, w, t0, T, BLOCK_T)
        _store_grad_fields(aggs, slot, ok, field, s[0], s[1], s[2], s[3], s[4])
        hand, write, read = _handoff(b, seg, n_seg, C, True, BLOCK_C, CHUNKS)
        c = _load_bwd_carries(hand_ptr, hand, read, B * C)
        x = _scan_carries_grad(s[5], s[6], s[7], s[8], s[9], c[0], c[1], c[2], c[3], c[4], W, True, BLOCK_C, CHUNKS)
        _store_grad_fields(bcarry_ptr, slot, ok, field, x[0], x[1], x[2], x[3], x[4])
        tl.debug_barrier()  # every read of the buffer above is done
        _store_grad_fields(hand_ptr, hand, write, B * C, x[5], x[6], x[7], x[8], x[9])
        tl.debug_barrier()  # the next segment's first chunk (another warp) reads it

    # Left to right: the left carries by a scan of the stored aggregates, then dk, dv, du, dw from both sides. The
    # scan comes first, so that none of its values is live beside the walks' seven tiles.
    for seg in range(n_seg):
        slot, ok = _slots(b, seg, n_chunks, C, BLOCK_C, CHUNKS)
        hand, write, read = _handoff(b, seg, n_seg, C, False, BLOCK_C, CHUNKS)
        c = _load_bwd_carries(hand_ptr, hand, read, B * C)
        a = _load_bwd_carries(aggs, slot, ok, field)
        x = _scan_carries_grad(a[0], a[1], a[2], a[3], a[4], c[0], c[1], c[2], c[3], c[4], W, False, BLOCK_C, CHUNKS)
        # The left carries replace the aggregates in the scratch (this thread's slot), and _bwd_tile reads them back
        # between its walks: in registers they would be live through the first.
        _store_grad_fields(aggs, slot, ok, field, x[0], x[1], x[2], x[3], x[4])
        tl.debug_barrier()
        _store_grad_fields(hand_ptr, hand, write, B * C, x[5], x[6], x[7], x[8], x[9])
        rows, offs, mask, t0, slot, ok, K, V, S_, Al, Be = _recompute(
            k_ptr, v_ptr, gy_ptr, fcarry_ptr, b, seg, w, u, T, C, n_chunks, field, BLOCK_T, BLOCK_C, CHUNKS)
        # The right carries: this thread's own, from the first pass.
        right = _load_bwd_carries(bcarry_ptr, slot, ok, field)
        # dk, dv stored row by row as the last walk completes them (STORE_ROWS): no (16, .) tile of offsets and
        # predicates is held through the walks (without it the backward spilled about 100 bytes, sm_90).
        col = t0 * C + ch
        _, _, du, dw = _bwd_tile(K, V, S_, Al, Be, rows, w, u, *right, aggs + slot, ok, field, t0, T, BLOCK_T,
                                 dk_ptr + col, dv_ptr + col, C, ch < C, True)
        # Per-chunk partial sums; the caller adds them (deterministic, no atomics).
        tl.store(part_ptr + slot, du, mask=ok)
        tl.store(part_ptr + slot + field, dw, mask=ok)
        tl.debug_barrier()


def _launch_grid(B: int, C: int):
    return lambda meta: (B, triton.cdiv(C, meta["BLOCK_C"]))


def forward(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, L: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """As wkv_triton.forward, in one launch: y (B, T, C) and the (6, B, n, C) chunk carries; L the chunk length."""
    B, T, C = k.shape
    _check_int32(T, C)
    n = triton.cdiv(T, L)
    carries = torch.empty(6, B, n, C, device=k.device, dtype=torch.float32)
    agg = torch.empty(3, B, n, C, device=k.device, dtype=torch.float32)
    hand = torch.empty(3, B, C, device=k.device, dtype=torch.float32)
    y = torch.empty_like(k)
    launch(_fused_fwd_kernel, (T, C, k.dtype, k.device), _launch_grid(B, C), w, u, k, v, carries, agg, hand, y, B, T, C,
           n, BLOCK_T=L)
    return y, carries


def backward(w, u, k, v, carries, grad_y, L: int) -> tuple[torch.Tensor, ...]:
    """As wkv_triton.backward, in one launch: (du, dw) as one fp32 (2, C) tensor, dk, dv."""
    B, T, C = k.shape
    _check_int32(T, C)
    n = triton.cdiv(T, L)
    grad_y = grad_y.contiguous()
    scratch = torch.empty(10, B, n, C, device=k.device, dtype=torch.float32)
    hand = torch.empty(5, B, C, device=k.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    partial = torch.empty(2, B, n, C, device=k.device, dtype=torch.float32)
    launch(_fused_bwd_kernel, (T, C, k.dtype, grad_y.dtype, k.device), _launch_grid(B, C), w, u, k, v, grad_y, carries,
           scratch, hand, dk, dv, partial, B, T, C, n, BLOCK_T=L)
    return partial.sum(dim=(1, 2)), dk, dv  # (2, B, n, C) -> (2, C)


def _check_int32(T: int, C: int) -> None:
    if T * C >= 2**31:
        raise OpInputError(f"Bi-WKV's one-launch kernels address a sequence with int32 offsets, and T C = {T * C:,} "
                           f"reaches 2^31; set TREAD_WKV_KERNEL=chunked for this shape.")


def traffic(B: int, T: int, C: int, element_size: int, L: int, block_c: int = 32
            ) -> dict[str, list[tuple[str, int, int]]]:
    """The one launch of each pass as (name, bytes moved, programs), each tensor counted once per time the kernel
    reads or writes it (the tiles are read in both directions), as wkv_triton.traffic; the carries handed between
    segments (B C floats a field) left out."""
    n = triton.cdiv(T, L)
    x = B * T * C * element_size
    slot = B * n * C * 4
    programs = B * triton.cdiv(C, block_c)
    return {
        # Right to left: read k, v; write the left aggregates and the right carries. Left to right: read the
        # aggregates; write the left carries; read them, the right carries, k and v; write y.
        "forward": [("fused", 2 * x + 6 * slot + 3 * slot + 3 * slot + 6 * slot + 2 * x + x, programs)],
        # Right to left: read k, v, dy and the forward carries; write the left aggregates and the right carries.
        # Left to right: read the aggregates, k, v, dy, both carries; write dk, dv and the du, dw partials.
        "backward": [("fused", 3 * x + 6 * slot + 10 * slot + 5 * slot + 3 * x + 11 * slot + 2 * x + 2 * slot,
                      programs), ("du, dw sums", 2 * slot, 1)],
    }
