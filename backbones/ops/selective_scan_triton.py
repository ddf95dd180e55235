"""Selective scan (Mamba's S6 recurrence) as fused Triton kernels, forward and backward.

Same signature and semantics as `backbones.ops.selective_scan.selective_scan` (mamba-ssm's
`selective_scan_fn` for real A and input-dependent B, C):

    delta <- softplus(delta + delta_bias)                         (each step optional)
    h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t,   h_{-1} = 0
    y_t = C_t h_t + D u_t,   out = y * silu(z)                    (D, z optional)

u, delta, z: (b, d, l); A: (d, n); B, C: (b, n, l) or grouped (b, g, n, l), channel c using group
c // (d // g); D, delta_bias: (d,). The pure-PyTorch op stays the CPU path and, with
`selective_scan_ref`, the oracle of the tests; `backbones/ops/cuda_kernels.py` decides which one runs.

Why fused: the PyTorch scans write whole (l, b, d, n) tensors (a, h, dh), n = 16 times the size of
the inputs, and the op is memory-bound. Here the state lives in registers and only (b, d, l)-sized
tensors touch global memory: forward reads u, delta, B, C, z and writes out; backward reads those and
the output gradient and writes the input gradients.

Layout of the work. One program owns one batch element and a block of BLOCK_D channels inside one
B/C group, and walks the sequence in chunks of BLOCK_T steps, carrying the state h (BLOCK_D, n) in
registers from chunk to chunk. Inside a chunk the BLOCK_T steps are not a Python-level loop: the
pairs (a_t, x_t) = (exp(delta_t A), delta_t B_t u_t) form a (BLOCK_D, n, BLOCK_T) tile and the
recurrence h_t = a_t h_{t-1} + x_t is one `tl.associative_scan` along time with the composition
(a1, x1) o (a2, x2) = (a1 a2, a2 x1 + x2). That keeps every load a coalesced (BLOCK_D, BLOCK_T) tile
(u is contiguous in l) instead of one strided column per step, and replaces BLOCK_T dependent
multiply-adds by a log-depth scan. The chunk's entering state enters as h_t = h_t^local + (prod a) h_in.

Stability, as in the PyTorch op: with delta >= 0 and A < 0 every a_t is in (0, 1]; the scan only
multiplies and adds; nothing is divided by a cumulative product.

Backward (reverse time, Mamba paper appendix / mamba-ssm's kernel structure): forward stores only the
state entering each chunk, (b, d, n_chunks, n), not all l states. Backward visits the chunks last to
first, recomputes the chunk's states from its stored entering state with the same scan, and runs the
adjoint recurrence dh_t = a_{t+1} dh_{t+1} + C_t dy_t as a reverse scan of (a_{t+1}, C_t dy_t), with
dh carried in registers from the later chunk. The decay gradient needs a_t h_{t-1}, which is h_t - x_t
(a subtraction of two values the scan already has, no division). Gradients of the per-channel
parameters (A, D, delta_bias) are summed over time in registers and written once per program; B and C
are shared by the channels of a group, so each program writes its partial sums (over its BLOCK_D
channels) and torch adds the few channel blocks afterwards: deterministic, unlike atomic adds.

Precision: fp32 state and accumulation for fp32 / bf16 / fp16 inputs (loaded in their dtype, widened
in registers); fp64 inputs compute in fp64 (used by the tests to check the algebra to 1e-10). The
output has u's dtype, each gradient its input's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from torch.autograd.function import once_differentiable

from backbones.ops.autocast import fp32_operator

# Elements of one (BLOCK_D, n, BLOCK_T) tile. Backward keeps about six such tiles alive (a, x, h, a_next,
# dh, products); 4096 fp32 elements over 8 warps are 16 registers per tile, which leaves room below the
# 255-register limit. A first guess for an H100, not tuned (no GPU was at hand when this was written).
_TILE_ELEMENTS = 4096
_NUM_WARPS = 8


@triton.jit
def _compose(a1, x1, a2, x2):
    """Composition of two affine steps h -> a h + x, the earlier one first."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _step_size(delta_raw, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """delta = softplus(delta_raw + bias), and d delta / d delta_raw (the sigmoid), as torch computes them."""
    x = delta_raw
    if HAS_BIAS:
        x = x + bias[:, None]
    if SOFTPLUS:
        # softplus = max(x, 0) + log1p(e^-|x|). log1p by Kahan's trick, log(w) e / (w - 1) with w = 1 + e:
        # plain log(1 + e) loses most digits for a typical Mamba dt of 1e-3 (e ~ 1e-3 in fp32).
        e = tl.exp(-tl.abs(x))
        w = 1.0 + e
        log1p_e = tl.where(w == 1.0, e, tl.log(w) * (e / (w - 1.0)))
        # Above 20, torch's softplus returns x itself (slope 1); match it.
        delta = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_e)
        slope = tl.where(x > 20.0, 1.0, 1.0 / (1.0 + tl.exp(-x)))
    else:
        delta = x
        slope = tl.full(x.shape, 1.0, x.dtype)
    return delta, slope


@triton.jit
def _scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr,  # inputs
    out_ptr, states_ptr,  # outputs
    d, g, L, N, n_chunks,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    STORE_STATES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    acc = A_ptr.dtype.element_ty  # fp32, or fp64 for fp64 inputs; the wrapper casts A to it
    # Program (channel block inside a group, batch element).
    pid, bi = tl.program_id(0), tl.program_id(1).to(tl.int64)
    k = d // g  # channels per group
    blocks_per_group = tl.cdiv(k, BLOCK_D)
    grp = pid // blocks_per_group
    ch_in_grp = (pid % blocks_per_group) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_mask = ch_in_grp < k
    ch = grp * k + ch_in_grp  # (BLOCK_D,) channel indices
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    steps = tl.arange(0, BLOCK_T)

    # Per-channel parameters; padded states get A = 0 (a = 1) and B = C = 0, so they stay 0 and read 0.
    dn_mask = ch_mask[:, None] & n_mask[None, :]
    A = tl.load(A_ptr + ch[:, None] * N + n[None, :], mask=dn_mask, other=0.0)  # (BLOCK_D, BLOCK_N)
    bias = tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(acc) if HAS_BIAS else None
    if HAS_D:
        D = tl.load(D_ptr + ch, mask=ch_mask, other=0.0).to(acc)
    # Row starts in the contiguous (b, d, l), (b, g, n, l) and (b, d, n_chunks, n) tensors.
    row = (bi * d + ch) * L  # (BLOCK_D,)
    bc_row = ((bi * g + grp) * N + n) * L  # (BLOCK_N,)
    state_row = (bi * d + ch) * n_chunks  # (BLOCK_D,)

    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=acc)
    for c in range(0, n_chunks):
        if STORE_STATES:
            # The state entering the chunk: all that backward needs to recompute the chunk.
            tl.store(states_ptr + (state_row + c)[:, None] * N + n[None, :], h, mask=dn_mask)
        t = c * BLOCK_T + steps
        t_mask = t < L
        dt_mask = ch_mask[:, None] & t_mask[None, :]
        nt_mask = n_mask[:, None] & t_mask[None, :]
        u = tl.load(u_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)  # (BLOCK_D, BLOCK_T)
        delta_raw = tl.load(delta_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)
        delta, _ = _step_size(delta_raw, bias, HAS_BIAS, SOFTPLUS)
        # Steps past the end (or padded channels) get delta = 0: a = 1 and x = 0 carry h through unchanged.
        delta = tl.where(dt_mask, delta, 0.0)
        Bt = tl.load(B_ptr + bc_row[:, None] + t[None, :], mask=nt_mask, other=0.0).to(acc)  # (BLOCK_N, BLOCK_T)
        Ct = tl.load(C_ptr + bc_row[:, None] + t[None, :], mask=nt_mask, other=0.0).to(acc)

        # Discretisation (ZOH for A, Euler for B, as in Mamba): a_t = exp(delta_t A), x_t = delta_t B_t u_t.
        a = tl.exp(delta[:, None, :] * A[:, :, None])  # (BLOCK_D, BLOCK_N, BLOCK_T)
        x = (delta * u)[:, None, :] * Bt[None, :, :]  # (BLOCK_D, BLOCK_N, BLOCK_T)
        a_cum, h_local = tl.associative_scan((a, x), 2, _compose)
        hs = h_local + a_cum * h[:, :, None]  # h_t for every step of the chunk

        # Readout y_t = C_t h_t (+ D u_t), gated by silu(z_t).
        y = tl.sum(hs * Ct[None, :, :], axis=1)  # (BLOCK_D, BLOCK_T)
        if HAS_D:
            y += D[:, None] * u
        if HAS_Z:
            z = tl.load(z_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)
            y *= z / (1.0 + tl.exp(-z))
        tl.store(out_ptr + row[:, None] + t[None, :], y.to(out_ptr.dtype.element_ty), mask=dt_mask)
        # The last step's state enters the next chunk (padded steps carried it through unchanged).
        h = tl.sum(tl.where(steps[None, None, :] == BLOCK_T - 1, hs, 0.0), axis=2)


@triton.jit
def _scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, dout_ptr, states_ptr,  # inputs
    du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr,  # outputs (some partial sums)
    d, g, L, N, n_chunks,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    acc = A_ptr.dtype.element_ty
    pid, bi = tl.program_id(0), tl.program_id(1).to(tl.int64)
    k = d // g
    blocks_per_group = tl.cdiv(k, BLOCK_D)
    grp = pid // blocks_per_group
    ch_in_grp = (pid % blocks_per_group) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_mask = ch_in_grp < k
    ch = grp * k + ch_in_grp
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    steps = tl.arange(0, BLOCK_T)

    dn_mask = ch_mask[:, None] & n_mask[None, :]
    A = tl.load(A_ptr + ch[:, None] * N + n[None, :], mask=dn_mask, other=0.0)  # (BLOCK_D, BLOCK_N)
    bias = tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(acc) if HAS_BIAS else None
    if HAS_D:
        D = tl.load(D_ptr + ch, mask=ch_mask, other=0.0).to(acc)
    row = (bi * d + ch) * L
    bc_row = ((bi * g + grp) * N + n) * L
    state_row = (bi * d + ch) * n_chunks
    # Partial sums of dB, dC over this program's channels: (b, g, blocks_per_group, n, l), summed by torch.
    part_row = (((bi * g + grp) * blocks_per_group + pid % blocks_per_group) * N + n) * L  # (BLOCK_N,)

    dh = tl.zeros((BLOCK_D, BLOCK_N), dtype=acc)  # dh_{t+1} entering the chunk from the later one
    dA = tl.zeros((BLOCK_D, BLOCK_N), dtype=acc)
    dD = tl.zeros((BLOCK_D,), dtype=acc)
    dbias = tl.zeros((BLOCK_D,), dtype=acc)
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        t = c * BLOCK_T + steps
        t_mask = t < L
        dt_mask = ch_mask[:, None] & t_mask[None, :]
        nt_mask = n_mask[:, None] & t_mask[None, :]
        # The chunk's inputs, and the step sizes one step later (a_{t+1} decays dh_{t+1} into dh_t).
        u = tl.load(u_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)  # (BLOCK_D, BLOCK_T)
        delta_raw = tl.load(delta_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)
        delta, slope = _step_size(delta_raw, bias, HAS_BIAS, SOFTPLUS)
        delta = tl.where(dt_mask, delta, 0.0)
        next_mask = ch_mask[:, None] & (t + 1 < L)[None, :]
        delta_next_raw = tl.load(delta_ptr + row[:, None] + t[None, :] + 1, mask=next_mask, other=0.0).to(acc)
        delta_next, _ = _step_size(delta_next_raw, bias, HAS_BIAS, SOFTPLUS)
        delta_next = tl.where(next_mask, delta_next, 0.0)  # past the end dh is 0, so a_{t+1} = 1 is harmless
        Bt = tl.load(B_ptr + bc_row[:, None] + t[None, :], mask=nt_mask, other=0.0).to(acc)  # (BLOCK_N, BLOCK_T)
        Ct = tl.load(C_ptr + bc_row[:, None] + t[None, :], mask=nt_mask, other=0.0).to(acc)
        dout = tl.load(dout_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)

        # Recompute the chunk's states from the stored entering state, exactly as forward did.
        h_in = tl.load(states_ptr + (state_row + c)[:, None] * N + n[None, :], mask=dn_mask, other=0.0)
        a = tl.exp(delta[:, None, :] * A[:, :, None])  # (BLOCK_D, BLOCK_N, BLOCK_T)
        du_ = delta * u  # (BLOCK_D, BLOCK_T)
        x = du_[:, None, :] * Bt[None, :, :]
        a_cum, h_local = tl.associative_scan((a, x), 2, _compose)
        hs = h_local + a_cum * h_in[:, :, None]

        # Gate and skip: out = (C h + D u) silu(z); dy is the gradient of C_t h_t + D u_t.
        if HAS_Z:
            z = tl.load(z_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)
            y = tl.sum(hs * Ct[None, :, :], axis=1)  # (BLOCK_D, BLOCK_T)
            if HAS_D:
                y += D[:, None] * u
            sig = 1.0 / (1.0 + tl.exp(-z))
            dz = dout * y * sig * (1.0 + z * (1.0 - sig))  # silu'(z) = sig (1 + z (1 - sig))
            tl.store(dz_ptr + row[:, None] + t[None, :], dz.to(dz_ptr.dtype.element_ty), mask=dt_mask)
            dy = dout * z * sig
        else:
            dy = dout

        # Adjoint scan, backwards in time: dh_t = a_{t+1} dh_{t+1} + C_t dy_t, dh entering from the right.
        a_next = tl.exp(delta_next[:, None, :] * A[:, :, None])  # (BLOCK_D, BLOCK_N, BLOCK_T)
        a_next_cum, dh_local = tl.associative_scan((a_next, Ct[None, :, :] * dy[:, None, :]), 2, _compose,
                                                   reverse=True)
        dhs = dh_local + a_next_cum * dh[:, :, None]

        # Readout: dC_t = sum_d dy_t h_t. Input x_t = delta_t B_t u_t: dB_t = sum_d dh_t delta_t u_t.
        part = part_row[:, None] + t[None, :]
        tl.store(dC_ptr + part, tl.sum(dy[:, None, :] * hs, axis=0), mask=nt_mask)  # (BLOCK_N, BLOCK_T)
        tl.store(dB_ptr + part, tl.sum(dhs * du_[:, None, :], axis=0), mask=nt_mask)
        dh_B = tl.sum(dhs * Bt[None, :, :], axis=1)  # (BLOCK_D, BLOCK_T)
        du = dh_B * delta
        if HAS_D:
            du += D[:, None] * dy
            dD += tl.sum(dy * u, axis=1)
        # Decay a_t = exp(delta_t A): the gradient of delta_t A is dh_t a_t h_{t-1} = dh_t (h_t - x_t).
        g_dA = dhs * (hs - x)  # (BLOCK_D, BLOCK_N, BLOCK_T)
        ddelta = dh_B * u + tl.sum(g_dA * A[:, :, None], axis=1)  # (BLOCK_D, BLOCK_T)
        dA += tl.sum(g_dA * delta[:, None, :], axis=2)
        ddelta = tl.where(dt_mask, ddelta * slope, 0.0)  # through softplus(delta_raw + bias)
        dbias += tl.sum(ddelta, axis=1)
        tl.store(du_ptr + row[:, None] + t[None, :], du.to(du_ptr.dtype.element_ty), mask=dt_mask)
        tl.store(ddelta_ptr + row[:, None] + t[None, :], ddelta.to(ddelta_ptr.dtype.element_ty), mask=dt_mask)
        # dh at the chunk's first step is dh_{t+1} for the last step of the chunk before it.
        dh = tl.sum(tl.where(steps[None, None, :] == 0, dhs, 0.0), axis=2)

    # Per-channel parameter gradients of this batch element: (b, d, n) and (b, d), summed over b by torch.
    tl.store(dA_ptr + (bi * d + ch)[:, None] * N + n[None, :], dA, mask=dn_mask)
    if HAS_D:
        tl.store(dD_ptr + bi * d + ch, dD, mask=ch_mask)
    if HAS_BIAS:
        tl.store(dbias_ptr + bi * d + ch, dbias, mask=ch_mask)


# Under TRITON_INTERPRET=1 (read when the kernels are decorated) they run on CPU tensors, through numpy.
_INTERPRETED = isinstance(_scan_fwd_kernel, InterpretedFunction)


def _blocks(k: int, n: int, length: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, BLOCK_T) for k channels per group, n states and length steps."""
    block_n = triton.next_power_of_2(n)
    block_d = min(16, triton.next_power_of_2(k))
    # Fill the tile budget with time steps, but no more than the sequence needs (short sequences, tests).
    block_t = max(2, _TILE_ELEMENTS // (block_d * block_n))
    block_t = min(block_t, max(2, triton.next_power_of_2(length)))
    return block_d, block_n, block_t


class _TritonScan(torch.autograd.Function):
    """The fused scan; inputs are contiguous, A / D / delta_bias already in the compute dtype."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, store):
        b, d, length = u.shape
        g, n = B.shape[1], A.shape[1]
        block_d, block_n, block_t = _blocks(d // g, n, length)
        n_chunks = triton.cdiv(length, block_t)
        grid = (g * triton.cdiv(d // g, block_d), b)
        out = torch.empty_like(u)
        # State entering each chunk, kept for backward: (b, d, n_chunks, n), n_chunks ~ l / BLOCK_T.
        states = u.new_empty((b, d, n_chunks, n) if store else (1,), dtype=A.dtype)
        dummy = A  # stands in for absent optional tensors; the constexpr flags keep it unread
        _scan_fwd_kernel[grid](
            u, delta, A, B, C, dummy if D is None else D, dummy if z is None else z,
            dummy if delta_bias is None else delta_bias, out, states,
            d, g, length, n, n_chunks,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=delta_softplus,
            STORE_STATES=store, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_T=block_t, num_warps=_NUM_WARPS,
        )
        if store:
            ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states)
            ctx.delta_softplus, ctx.blocks = delta_softplus, (block_d, block_n, block_t)
        return out

    @staticmethod
    @once_differentiable
    @fp32_operator  # the engine may replay the forward's autocast state in backward (CUDA)
    def backward(ctx, dout):
        u, delta, A, B, C, D, z, delta_bias, states = ctx.saved_tensors
        b, d, length = u.shape
        g, n = B.shape[1], A.shape[1]
        block_d, block_n, block_t = ctx.blocks  # backward must cut the chunks where forward stored states
        blocks_per_group = triton.cdiv(d // g, block_d)
        grid = (g * blocks_per_group, b)
        acc = A.dtype
        du, ddelta = torch.empty_like(u), torch.empty_like(delta)
        dz = torch.empty_like(z) if z is not None else None
        # Sums still to be taken by torch: over the batch (A, D, delta_bias) and over channel blocks (B, C).
        dA = u.new_empty(b, d, n, dtype=acc)
        dD = u.new_empty(b, d, dtype=acc) if D is not None else None
        dbias = u.new_empty(b, d, dtype=acc) if delta_bias is not None else None
        dB = u.new_empty(b, g, blocks_per_group, n, length, dtype=acc)
        dC = torch.empty_like(dB)
        dummy = A
        _scan_bwd_kernel[grid](
            u, delta, A, B, C, dummy if D is None else D, dummy if z is None else z,
            dummy if delta_bias is None else delta_bias, dout.contiguous(), states,
            du, ddelta, dummy if dz is None else dz, dA, dB, dC, dummy if dD is None else dD,
            dummy if dbias is None else dbias,
            d, g, length, n, states.shape[2],
            HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
            SOFTPLUS=ctx.delta_softplus, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_T=block_t, num_warps=_NUM_WARPS,
        )
        dB, dC = dB.sum(2).to(B.dtype), dC.sum(2).to(C.dtype)  # (b, g, blocks, n, l) -> (b, g, n, l)
        dA = dA.sum(0)
        dD = dD.sum(0) if dD is not None else None
        dbias = dbias.sum(0) if dbias is not None else None
        return du, ddelta, dA, dB, dC, dD, dz, dbias, None, None


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
    if B.dim() != C.dim() or B.dim() not in (3, 4):
        raise ValueError(f"B and C must both be (b, n, l) or (b, g, n, l); got {tuple(B.shape)} and {tuple(C.shape)}")
    if B.dim() == 4 and u.shape[1] % B.shape[1]:
        raise ValueError(f"channels d={u.shape[1]} are not divisible by the {B.shape[1]} groups of B and C")
    if not (u.is_cuda or _INTERPRETED):
        raise ValueError("selective_scan_triton needs CUDA tensors (or TRITON_INTERPRET=1 set before import, "
                         "for tests); on CPU use backbones.ops.selective_scan.selective_scan")
    grouped = B.dim() == 4
    acc = torch.float64 if u.dtype == torch.float64 else torch.float32
    # The kernels index every tensor as contiguous; the Mamba block already passes contiguous ones.
    u, delta = u.contiguous(), delta.contiguous()
    z = z.contiguous() if z is not None else None
    if not grouped:
        B, C = B[:, None], C[:, None]  # (b, n, l) -> (b, 1, n, l)
    B, C = B.contiguous(), C.contiguous()
    # The small per-channel parameters go to the compute dtype here; autograd casts their gradients back.
    A_c = A.to(acc).contiguous()
    D_c = D.to(acc).contiguous() if D is not None else None
    bias_c = delta_bias.to(acc).contiguous() if delta_bias is not None else None
    inputs = (u, delta, A_c, B, C, D_c, z, bias_c)
    # Without a gradient to compute, forward skips storing the chunk states.
    store = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    return _TritonScan.apply(*inputs, bool(delta_softplus), store)
