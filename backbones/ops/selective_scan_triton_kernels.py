"""The selective scan's Triton kernels, forward and backward; why they are laid out so, how they are launched,
tuned and counted: backbones/ops/selective_scan_triton.py."""

import triton
import triton.language as tl

# Triton's JIT specialises an integer argument at launch when it is a multiple of 16 (a divisibility hint) or 1 (a
# constant). Built both ways at b64 d768 L256 N16 and at L = 1,024, 4,096 and 16,384 with the batch keeping 16,384
# tokens (`python -m train.bench.kernel_compile --unspecialised`, sm_90; docs/reports/2026-11-27-scan-specialisation.md):
# - L, specialised: its divisibility is what vectorises the (BLOCK_D, CHUNK) loads along time, so a thread holds
#   consecutive steps and composes them in registers before the cross-lane scan (mamba-ssm's layout). Forward BLOCK_D 4
#   at 4 warps, bf16: 696 SASS instructions and 10 shuffles, against 1,120 and 80 with L unspecialised. A length that
#   is not a multiple of 16 gets the unvectorised build.
# - n_chunks and g, specialised: one chunk (n_chunks == 1) drops the chunk loop (696 instructions against 848), one
#   group (g == 1) folds the group arithmetic (against 720).
# - d, N, batch and slots: no instruction changes with them (every (b, d, l) address is a multiple of L; batch is only
#   in the tuning key), so they are not specialised: a new batch size or width builds no new binary. (Specialised,
#   batch 1 built a second binary whose register allocation spilled where the others did not.)
_SHAPE_ARGS = ["d", "N"]  # and backward's batch and slots


@triton.jit
def _compose(a1, x1, a2, x2):
    """Composition of two affine steps h -> a h + x, the earlier one first."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _compose_pre(a1, x1, s1, a2, x2, s2):
    """_compose, plus s: the composite's output before its last step's input, a_t h_{t-1} (no cancellation)."""
    return a1 * a2, a2 * x1 + x2, a2 * x1 + s2


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


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, states_ptr,
    d, g, L, N, n_chunks,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    STORE_STATES: tl.constexpr, EXP2: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    acc = A_ptr.dtype.element_ty  # fp32, or fp64 for fp64 inputs; the wrapper casts A to it
    pid, bi = tl.program_id(0), tl.program_id(1).to(tl.int64)
    k = d // g  # channels per group
    blocks_per_group = tl.cdiv(k, BLOCK_D)
    grp = pid // blocks_per_group
    ch_in_grp = (pid % blocks_per_group) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_mask = ch_in_grp < k
    ch = grp * k + ch_in_grp  # (BLOCK_D,) channel indices
    ncol = tl.arange(0, BLOCK_N)
    steps = tl.arange(0, CHUNK)
    bias = tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(acc) if HAS_BIAS else None
    row = (bi * d + ch) * L  # (BLOCK_D,) row starts in the contiguous (b, d, l) tensors
    bc_base = (bi * g + grp) * N * L  # start of this batch element's (n, l) block of B and C
    state_row = (bi * d + ch) * (n_chunks - 1)  # (b, d, n_chunks - 1, n)

    carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=acc)  # column i: state i entering the chunk
    for c in range(0, n_chunks):
        t = c * CHUNK + steps
        t_mask = t < L
        dt_mask = ch_mask[:, None] & t_mask[None, :]
        u = tl.load(u_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)  # (BLOCK_D, CHUNK)
        delta_raw = tl.load(delta_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)
        delta, _ = _step_size(delta_raw, bias, HAS_BIAS, SOFTPLUS)
        # Padded steps and channels get delta = 0: a = 1 and x = 0 carry h through unchanged.
        delta = tl.where(dt_mask, delta, 0.0)
        du = delta * u
        y = tl.zeros((BLOCK_D, CHUNK), dtype=acc)
        for i in range(0, N):
            A_i = tl.load(A_ptr + ch * N + i, mask=ch_mask, other=0.0)  # (BLOCK_D,)
            B_i = tl.load(B_ptr + bc_base + i * L + t, mask=t_mask, other=0.0).to(acc)  # (CHUNK,)
            C_i = tl.load(C_ptr + bc_base + i * L + t, mask=t_mask, other=0.0).to(acc)
            # a = exp(delta A): exp2 of A log2(e) in fp32, exp in fp64 (inline: a helper call costs the
            # interpreter more than the arithmetic).
            if EXP2:
                a = tl.exp2(delta * (A_i * 1.4426950408889634)[:, None])  # (BLOCK_D, CHUNK)
            else:
                a = tl.exp(delta * A_i[:, None])
            h_in = tl.zeros((BLOCK_D,), dtype=acc)  # (BLOCK_D,); zero entering the first chunk
            if c > 0:
                h_in = tl.sum(tl.where(ncol[None, :] == i, carry, 0.0), axis=1)
            # The entering state joins the first step's input: x_0 + a_0 h_in.
            x = du * B_i[None, :] + tl.where(steps[None, :] == 0, a * h_in[:, None], 0.0)
            _, h = tl.associative_scan((a, x), 1, _compose)  # h_t for every step of the chunk
            y += h * C_i[None, :]
            if c + 1 < n_chunks:
                h_last = tl.sum(tl.where(steps[None, :] == CHUNK - 1, h, 0.0), axis=1)
                carry = tl.where(ncol[None, :] == i, h_last[:, None], carry)
                if STORE_STATES:  # the state entering chunk c + 1: all backward needs to rebuild it
                    tl.store(states_ptr + (state_row + c) * N + i, h_last, mask=ch_mask)
        if HAS_D:
            y += tl.load(D_ptr + ch, mask=ch_mask, other=0.0).to(acc)[:, None] * u
        if HAS_Z:
            z = tl.load(z_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)
            y *= z / (1.0 + tl.exp(-z))
        tl.store(out_ptr + row[:, None] + t[None, :], y.to(out_ptr.dtype.element_ty), mask=dt_mask)


@triton.jit(do_not_specialize=[*_SHAPE_ARGS, "batch", "slots"])
def _scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, dout_ptr, states_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr,
    batch, d, g, L, N, n_chunks, slots,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    EXP2: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, CPP: tl.constexpr, BLOCK_D: tl.constexpr,
):
    acc = A_ptr.dtype.element_ty
    pid, bi = tl.program_id(0), tl.program_id(1).to(tl.int64)
    k = d // g
    parts = tl.cdiv(k, CPP)  # channel super-blocks per group, each one program
    grp = pid // parts
    ncol = tl.arange(0, BLOCK_N)
    steps = tl.arange(0, CHUNK)
    bc_base = (bi * g + grp) * N * L
    # This program's (n, l) rows of dB, dC: slot pid % parts of its (batch, group)'s `slots` (those of the
    # smallest CPP the autotuner may pick; torch sums the first `parts`). `batch` is only in the tuning key.
    part_base = ((bi * g + grp) * slots + pid % parts) * N * L

    for sub in range(0, CPP, BLOCK_D):
        ch_in_grp = (pid % parts) * CPP + sub + tl.arange(0, BLOCK_D)
        ch_mask = ch_in_grp < k
        ch = grp * k + ch_in_grp
        bias = tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(acc) if HAS_BIAS else None
        D = tl.load(D_ptr + ch, mask=ch_mask, other=0.0).to(acc) if HAS_D else None
        row = (bi * d + ch) * L
        state_row = (bi * d + ch) * (n_chunks - 1)
        dh_carry = tl.zeros((BLOCK_D, BLOCK_N), dtype=acc)  # column i: dh_i at the later chunk's first step
        dA = tl.zeros((BLOCK_D, BLOCK_N), dtype=acc)
        dD = tl.zeros((BLOCK_D,), dtype=acc)
        dbias = tl.zeros((BLOCK_D,), dtype=acc)
        for ci in range(0, n_chunks):
            c = n_chunks - 1 - ci
            t = c * CHUNK + steps
            t_mask = t < L
            dt_mask = ch_mask[:, None] & t_mask[None, :]
            u = tl.load(u_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)  # (BLOCK_D, CHUNK)
            delta_raw = tl.load(delta_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)
            delta, slope = _step_size(delta_raw, bias, HAS_BIAS, SOFTPLUS)
            delta = tl.where(dt_mask, delta, 0.0)
            # Step sizes one step later: a_{t+1} decays dh_{t+1} into dh_t (past the end dh is 0, any a does).
            next_mask = ch_mask[:, None] & (t + 1 < L)[None, :]
            delta_next_raw = tl.load(delta_ptr + row[:, None] + t[None, :] + 1, mask=next_mask, other=0.0).to(acc)
            delta_next, _ = _step_size(delta_next_raw, bias, HAS_BIAS, SOFTPLUS)
            delta_next = tl.where(next_mask, delta_next, 0.0)
            dout = tl.load(dout_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)
            if HAS_Z:
                z = tl.load(z_ptr + row[:, None] + t[None, :], mask=dt_mask, other=0.0).to(acc)
                sig = 1.0 / (1.0 + tl.exp(-z))
                dy = dout * z * sig  # out = y silu(z): dy is the gradient of y = C h + D u
            else:
                dy = dout
            du = delta * u
            dh_B = tl.zeros((BLOCK_D, CHUNK), dtype=acc)  # sum_i dh_i B_i
            dh_A = tl.zeros((BLOCK_D, CHUNK), dtype=acc)  # sum_i A_i dh_i a_i h_i,prev: gradient of delta via a
            y = tl.zeros((BLOCK_D, CHUNK), dtype=acc)
            for i in range(0, N):
                A_i = tl.load(A_ptr + ch * N + i, mask=ch_mask, other=0.0)  # (BLOCK_D,)
                B_i = tl.load(B_ptr + bc_base + i * L + t, mask=t_mask, other=0.0).to(acc)  # (CHUNK,)
                C_i = tl.load(C_ptr + bc_base + i * L + t, mask=t_mask, other=0.0).to(acc)
                # Rebuild state i over the chunk from the stored entering state (zero before chunk 1).
                h_in = tl.load(states_ptr + (state_row + c - 1) * N + i, mask=ch_mask & (c > 0), other=0.0)
                if EXP2:
                    a = tl.exp2(delta * (A_i * 1.4426950408889634)[:, None])  # (BLOCK_D, CHUNK)
                    a_next = tl.exp2(delta_next * (A_i * 1.4426950408889634)[:, None])
                else:
                    a = tl.exp(delta * A_i[:, None])
                    a_next = tl.exp(delta_next * A_i[:, None])
                first = tl.where(steps[None, :] == 0, a * h_in[:, None], 0.0)  # a_0 h_in
                _, h, s = tl.associative_scan((a, du * B_i[None, :] + first, first), 1, _compose_pre)  # h_t, a_t h_{t-1}
                # Adjoint, backwards in time: dh_t = a_{t+1} dh_{t+1} + C_t dy_t, dh entering from the later chunk.
                dh_last = tl.zeros((BLOCK_D,), dtype=acc)  # zero after the last chunk
                if c + 1 < n_chunks:
                    dh_last = tl.sum(tl.where(ncol[None, :] == i, dh_carry, 0.0), axis=1)
                seed = C_i[None, :] * dy + tl.where(steps[None, :] == CHUNK - 1, a_next * dh_last[:, None], 0.0)
                _, dh = tl.associative_scan((a_next, seed), 1, _compose, reverse=True)
                # Readout dC_t = sum_d dy_t h_t; input x_t = delta_t u_t B_t: dB_t = sum_d dh_t delta_t u_t.
                # Each channel block adds into this program's partial row (the first block writes it).
                part = part_base + i * L + t
                dC = tl.sum(dy * h, axis=0) + tl.load(dC_ptr + part, mask=t_mask & (sub > 0), other=0.0)
                dB = tl.sum(dh * du, axis=0) + tl.load(dB_ptr + part, mask=t_mask & (sub > 0), other=0.0)
                tl.store(dC_ptr + part, dC, mask=t_mask)
                tl.store(dB_ptr + part, dB, mask=t_mask)
                dh_B += dh * B_i[None, :]
                g_a = dh * s  # gradient of delta_t A_i through a_t = exp(delta_t A_i)
                dh_A += g_a * A_i[:, None]
                dA = tl.where(ncol[None, :] == i, dA + tl.sum(g_a * delta, axis=1)[:, None], dA)
                if HAS_Z:
                    y += h * C_i[None, :]
                if c > 0:
                    dh_first = tl.sum(tl.where(steps[None, :] == 0, dh, 0.0), axis=1)
                    dh_carry = tl.where(ncol[None, :] == i, dh_first[:, None], dh_carry)
            du_grad = dh_B * delta
            if HAS_D:
                du_grad += D[:, None] * dy
                dD += tl.sum(dy * u, axis=1)
            ddelta = tl.where(dt_mask, (dh_B * u + dh_A) * slope, 0.0)  # through softplus(delta_raw + bias)
            dbias += tl.sum(ddelta, axis=1)
            tl.store(du_ptr + row[:, None] + t[None, :], du_grad.to(du_ptr.dtype.element_ty), mask=dt_mask)
            tl.store(ddelta_ptr + row[:, None] + t[None, :], ddelta.to(ddelta_ptr.dtype.element_ty), mask=dt_mask)
            if HAS_Z:
                if HAS_D:
                    y += D[:, None] * u
                dz = dout * y * sig * (1.0 + z * (1.0 - sig))  # silu'(z) = sig (1 + z (1 - sig))
                tl.store(dz_ptr + row[:, None] + t[None, :], dz.to(dz_ptr.dtype.element_ty), mask=dt_mask)
        # Per-channel parameter gradients of this batch element, (b, d, n) and (b, d), summed over b by torch.
        tl.store(dA_ptr + (bi * d + ch)[:, None] * N + ncol[None, :], dA, mask=ch_mask[:, None] & (ncol < N)[None, :])
        if HAS_D:
            tl.store(dD_ptr + bi * d + ch, dD, mask=ch_mask)
        if HAS_BIAS:
            tl.store(dbias_ptr + bi * d + ch, dbias, mask=ch_mask)
        # The next channel block reads the partial rows this one wrote (other threads): make them visible.
        tl.debug_barrier()
