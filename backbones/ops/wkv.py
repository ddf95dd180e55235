"""Bidirectional WKV (Vision-RWKV's Bi-WKV) in pure PyTorch: an exact O(B T C) chunked form with a
hand-written backward, and the O(T^2) definition it is tested against.

    y_t = [sum_{i!=t} e^{-(|t-i|-1) w + k_i} v_i + e^{u+k_t} v_t] / [sum_{i!=t} e^{-(|t-i|-1) w + k_i} + e^{u+k_t}]

w, u: (C,) per-channel decay and bonus, already divided by T by the caller; k, v: (B, T, C).

Why it is exact and O(B T C). Write K(t, i) = e^{-(|t-i|-1) w} (i != t), K(t, t) = e^u. K depends only on
the distance, so the sequence is cut into n chunks of L tokens and everything a token receives from
outside its chunk arrives through two "virtual tokens" next to the chunk: a left carry at position -1,
H^L_c = sum_{i before chunk c} K(cL, i) e^{k_i} [1, v_i], and a right carry at position L. Because
K(cL + j, i) = e^{-j w} K(cL, i) for every earlier i, the chunk's outputs are its L tokens e^{k} [1, v]
times an L x L matrix per channel plus its two carries times a 2 x L matrix -- batched matmuls over all
chunks. The carries obey H^L_{c+1} = e^{-L w} H^L_c + (what chunk c adds), a loop over the n = T / L
chunks on (C, B) slabs (mirrored for the right carry). The matmuls cost O(B T L C), the loop O(B T C).

Why it is safe in fp32. No exponent of an unbounded quantity is taken:
- keys are shifted by their maximum m within each chunk, so e^{k - m} <= 1;
- each carry is kept as (integer log-scale h, mantissa M) with h following the carry's magnitude (a
  log-sum-exp-style running scale). Far-away terms are never shifted by one global maximum (which is what
  underflows early prefix terms in a single cumsum), and integer h makes every rescaling exact, so the
  error does not grow with the number of chunks a carry travels;
- the chunk length is capped so that |w| L <= _MAX_CHUNK_DECAY = 12: every decay factor inside a chunk is
  within e^{+-12}, and a key that underflows (e^{k - m} < 1e-38) is at least e^{87 - 24} times smaller than
  another term of the same output. Faster decays get shorter chunks, down to L = 1, where all decay lives
  in the log-scaled carries;
- a carry enters its chunk under the tokens' scale m, capped at e^_CARRY_CAP above it (see forward).
The bonus enters the matrix as e^{u - max(u, 0)}, the weights into an output all divided by e^{max(u, 0)}, so
any u is exact: a large u overflows nothing, a very negative one only makes the token's own weight underflow.
Every stabiliser (m, h) is a constant that cancels exactly (the cap aside, whose effect is below fp32
resolution), so the gradients are those of the definition.
bf16 / fp16 inputs are computed in fp32 and returned in their dtype.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from backbones.ops.autocast import fp32_operator
from backbones.ops.op_inputs import OpInputError, check_float, check_shape

# Largest |w| L inside one chunk: every decay factor within a chunk stays inside e^{+-12}.
_MAX_CHUNK_DECAY = 12.0
# Carries are stored at most e^60 above the chunk's own tokens: with decays inside e^{+-12} every column of
# the chunk matmul then stays below e^74 (fp32 overflows at e^88.7), see _BiWKV.forward.
_CARRY_CAP = 60.0


def _chunking(w: torch.Tensor, T: int, chunk_len: int) -> tuple[int, int]:
    """(L, n): chunk length at most chunk_len with |w| L <= _MAX_CHUNK_DECAY, and n = ceil(T / L) chunks."""
    w_max = float(w.detach().abs().max()) if w.numel() else 0.0
    longest = min(chunk_len, T)
    if w_max * longest > _MAX_CHUNK_DECAY:
        longest = max(1, int(_MAX_CHUNK_DECAY / w_max))
    n = -(-T // longest)
    return -(-T // n), n  # the same n with the shortest L, so padding stays below n tokens


def _chunk_matrices(w: torch.Tensor, u: torch.Tensor, L: int) -> tuple[torch.Tensor, ...]:
    """The per-channel matrices of one chunk, gathered from a table of K by distance.

    table (C, L + 2): K at distance d, e^u at d = 0 and e^{-(d - 1) w} beyond. Returns
    op (C, L, L): weight K(|j' - j|) from token j' to output j of the same chunk;
    op_carry (C, 2, L): weight from the left carry (a virtual token at position -1), K(j + 1), and from
    the right carry (position L), K(L - j), to output j;
    to_carry (C, L, 2): weight of token j' in the left carry of the next chunk, K(L - j'), and in the
    right carry of the previous chunk, K(j' + 1);
    and the distance of every entry of the three, concatenated, for the backward pass.
    """
    d = torch.arange(L + 2, device=w.device)
    log_table = -(d - 1).to(w.dtype) * w[:, None]  # (C, L + 2)
    log_table[:, 0] = u
    j = torch.arange(L, device=w.device)
    dist = torch.cat(
        [(j[:, None] - j[None, :]).abs().flatten(), torch.cat([j + 1, L - j]), torch.stack([L - j, j + 1], 1).flatten()]
    )  # (L L + 2 L + 2 L,)
    # The weights into an output (op, op_carry) are divided by e^{max(u, 0)}, a constant that cancels in num / den,
    # so that e^u never overflows (u >= 88.7 in fp32); the weights into the carries (to_carry) are not scaled.
    # Detached: each entry's gradient is taken of its log, which the constant does not change.
    to_out = (log_table - u.detach().clamp(min=0)[:, None]).exp().index_select(1, dist[: L * L + 2 * L])
    op, op_carry = to_out.split([L * L, 2 * L], dim=1)  # (C, L L + 2 L) -> (C, L L), (C, 2 L)
    to_carry = log_table.exp().index_select(1, dist[L * L + 2 * L :])  # (C, 2 L)
    return op.view(-1, L, L), op_carry.view(-1, 2, L), to_carry.view(-1, L, 2), dist  # (C, ...) -> matrices


def _carry_scan(
    S: torch.Tensor, m: torch.Tensor, decay: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """H_{c+1} = e^{-decay} H_c + e^{m_c} S_c from H_0 = 0, for both directions at once.

    S: (2, C, 2, B, n) each chunk's contribution (direction, channel, den/num, batch, chunk) under its key
    max m: (2, C, B, n); decay = L w: (C,). Returns the carry INTO each chunk as log-scale h (2, C, B, n)
    and mantissa M (2, C, 2, B, n), H = e^h M, plus the step factors f, g (2, C, B, n) of
    M_{c+1} = f_c M_c + g_c S_c that the backward pass reuses.
    """
    n = S.shape[-1]
    # Log-magnitude of each contribution, from its (positive) denominator channel.
    log_S = m + S[:, :, 0].log()
    h = torch.full_like(m[..., 0], float("-inf"))
    M = torch.zeros_like(S[..., 0])
    hs, Ms, fs, gs = [], [], [], []
    for c in range(n):
        hs.append(h)
        Ms.append(M)
        # The new scale is the log-magnitude of the larger term, rounded to an integer: h_old - h is then
        # exact in floating point (so f carries one rounding, not one per chunk travelled), and the
        # denominator mantissa stays within [e^-0.5, 2 e^0.5].
        h_old, h = h, torch.maximum(h - decay[:, None] + M[:, :, 0].log(), log_S[..., c]).round()
        f, g = torch.exp((h_old - h) - decay[:, None]), torch.exp(m[..., c] - h)
        fs.append(f)
        gs.append(g)
        M = M * f[:, :, None] + S[..., c] * g[:, :, None]
    return torch.stack(hs, -1), torch.stack(Ms, -1), torch.stack(fs, -1), torch.stack(gs, -1)


def _carry_scan_backward(
    dM: torch.Tensor, M: torch.Tensor, f: torch.Tensor, g: torch.Tensor, L: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adjoint of _carry_scan: gradients of the contributions S (2, C, 2, B, n) and of decay's w, (C,).

    dM: (2, C, 2, B, n) gradient of each chunk's incoming carry mantissa; M, f, g from the forward scan.
    """
    n = dM.shape[-1]
    dS = torch.empty_like(dM)
    dw = torch.zeros_like(dM[..., 0])
    lam = torch.zeros_like(dM[..., 0])  # gradient of the carry leaving the current chunk
    for c in range(n - 1, -1, -1):
        dS[..., c] = lam * g[:, :, None, :, c]
        # d f_c / d w = -L f_c, since f_c = exp(h_c - L w - h_{c+1}).
        dw -= L * lam * f[:, :, None, :, c] * M[..., c]
        lam = lam * f[:, :, None, :, c] + dM[..., c]
    return dS, dw.sum(dim=(0, 2, 3))


def _to_chunks(x: torch.Tensor, n: int, L: int, pad_value: float) -> torch.Tensor:
    """(B, T, C) -> (C, B, n, L), padding T to n L with pad_value (a 2-D transpose, which torch blocks)."""
    B, T, C = x.shape
    if n * L > T:
        x = F.pad(x, (0, 0, 0, n * L - T), value=pad_value)
    return x.reshape(B * n * L, C).t().contiguous().view(C, B, n, L)  # (B, nL, C) -> (C, B nL) -> (C, B, n, L)


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """(C, B, n, L) -> (B, T, C), dropping the padding."""
    C, B, n, L = x.shape
    return x.reshape(C, B * n * L).t().contiguous().view(B, n * L, C)[:, :T]  # (C, B nL) -> (B nL, C) -> (B, nL, C)


def chunked_forward(
    w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_len: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[int, int]]:
    """The chunked op's forward: y (B, T, C), the tensors its backward needs and (T, L)."""
    B, T, C = k.shape
    L, n = _chunking(w, T, chunk_len)
    op, op_carry, to_carry, dist = _chunk_matrices(w, u, L)
    # A padded key is -inf, so its weight e^{k - m} is exactly 0.
    k = _to_chunks(k, n, L, float("-inf"))
    v = _to_chunks(v, n, L, 0.0)

    # Token weights under each chunk's key max: X[:, 0] = e^{k - m}, X[:, 1] = e^{k - m} v.
    m = k.amax(dim=-1)  # (C, B, n)
    X = torch.empty(C, 2, B, n, L, device=k.device, dtype=k.dtype)
    torch.exp(k - m[..., None], out=X[:, 0])
    torch.mul(X[:, 0], v, out=X[:, 1])
    X_mat = X.view(C, 2 * B * n, L)  # (C, 2, B, n, L) -> (C, 2Bn, L)

    # What each chunk adds to its neighbours' carries, then the carries themselves.
    S = torch.bmm(X_mat, to_carry).view(C, 2, B, n, 2)  # (C, 2Bn, 2) -> (C, 2, B, n, 2)
    # The right carry runs from the last chunk, so its chunk order is reversed to reuse one scan.
    S = torch.stack([S[..., 0], S[..., 1].flip(-1)])  # (2, C, 2, B, n)
    m2 = torch.stack([m, m.flip(-1)])  # (2, C, B, n)
    h, M, f, g = _carry_scan(S, m2, L * w)
    h = torch.stack([h[0], h[1].flip(-1)])  # (2, C, B, n), back to chunk order
    M = torch.stack([M[0], M[1].flip(-1)])  # (2, C, 2, B, n)

    # Carries as two more columns of the chunk, under the tokens' scale m. Where a carry exceeds the
    # tokens by more than e^_CARRY_CAP it is scaled down to that cap: the tokens then weigh e^{-cap}
    # times the carry (at most e^{-cap + 2 * 12 + 2} L ~ 1e-14 of the output) instead of less.
    carry_scale = torch.exp(h - torch.maximum(m, h.amax(dim=0) - _CARRY_CAP))  # (2, C, B, n)
    V = (M * carry_scale[:, :, None]).permute(1, 2, 3, 4, 0)  # (2, C, 2, B, n) -> (C, 2, B, n, 2)
    V_mat = V.reshape(C, 2 * B * n, 2)  # (C, 2, B, n, 2) -> (C, 2Bn, 2)

    # Every output of a chunk from its L tokens and two carries: batched matmuls per channel.
    Y = torch.bmm(X_mat, op).baddbmm_(V_mat, op_carry).view(C, 2, B, n, L)  # (C, 2Bn, L) -> (C, 2, B, n, L)
    y = Y[:, 1] / Y[:, 0]

    return _from_chunks(y, T), (op, op_carry, to_carry, dist, X, V_mat, Y[:, 0], y, carry_scale, M, f, g), (T, L)


@fp32_operator  # the engine may replay the forward's autocast state in backward (CUDA)
def chunked_backward(
    saved: tuple[torch.Tensor, ...], T: int, L: int, grad_y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked op's backward: dw, du, dk, dv from chunked_forward's saved tensors and (T, L)."""
    op, op_carry, to_carry, dist, X, V_mat, den, y, carry_scale, M, f, g = saved
    C, _, B, n, _ = X.shape
    X_mat = X.view(C, 2 * B * n, L)  # (C, 2, B, n, L) -> (C, 2Bn, L)
    grad_y = _to_chunks(grad_y, n, L, 0.0)

    # Gradient of Y = [den, num] through y = num / den.
    dY = torch.empty_like(X)
    torch.div(grad_y, den, out=dY[:, 1])
    torch.mul(dY[:, 1], y, out=dY[:, 0]).neg_()
    dY_mat = dY.view(C, 2 * B * n, L)  # (C, 2, B, n, L) -> (C, 2Bn, L)

    # Through the chunk matmuls: gradients of the matrices and of the carry columns.
    d_op = torch.bmm(X_mat.transpose(1, 2), dY_mat)  # (C, L, L)
    d_op_carry = torch.bmm(V_mat.transpose(1, 2), dY_mat)  # (C, 2, L)
    dV = torch.bmm(dY_mat, op_carry.transpose(1, 2)).view(C, 2, B, n, 2)  # (C, 2Bn, 2) -> (C, 2, B, n, 2)

    # Through the carries, back to each chunk's contributions S.
    dM = dV.permute(4, 0, 1, 2, 3) * carry_scale[:, :, None]  # (C, 2, B, n, 2) -> (2, C, 2, B, n)
    dS, dw_scan = _carry_scan_backward(
        torch.stack([dM[0], dM[1].flip(-1)]), torch.stack([M[0], M[1].flip(-1)]), f, g, L
    )
    dS_mat = torch.stack([dS[0], dS[1].flip(-1)], dim=-1).view(C, 2 * B * n, 2)  # (C, 2, B, n, 2) -> (C, 2Bn, 2)

    # Gradient of X = e^{k - m} [1, v] from the chunk matmul and from the carries.
    dX = torch.bmm(dY_mat, op.transpose(1, 2)).baddbmm_(dS_mat, to_carry.transpose(1, 2)).view_as(X)
    d_to_carry = torch.bmm(X_mat.transpose(1, 2), dS_mat)  # (C, L, 2)
    dkv = torch.empty_like(X)  # (C, 2, B, n, L): dk, dv
    torch.addcmul(dX[:, 0] * X[:, 0], dX[:, 1], X[:, 1], out=dkv[:, 0])
    torch.mul(dX[:, 1], X[:, 0], out=dkv[:, 1])

    # Parameters: every matrix entry is a table entry K(d) = e^{-(d - 1) w} (e^u at d = 0), so the
    # gradient of log K(d) sums entry * gradient over the entries at distance d.
    entries = torch.cat(
        [(d_op * op).view(C, -1), (d_op_carry * op_carry).view(C, -1), (d_to_carry * to_carry).view(C, -1)], 1
    )  # (C, L L + 4 L)
    d_log = torch.zeros(C, L + 2, device=op.device, dtype=op.dtype).index_add_(1, dist, entries)
    d = torch.arange(L + 2, device=op.device, dtype=op.dtype)
    dw = (d_log[:, 1:] * (1 - d[1:])).sum(dim=1) + dw_scan
    du = d_log[:, 0]
    # Both back to (B, T, C) with one transpose.
    dk, dv = _from_chunks(dkv.view(C, 2 * B, n, L), T).view(2, B, T, C).unbind(0)  # (2B, T, C) -> (2, B, T, C)
    return dw, du, dk, dv


class _BiWKV(torch.autograd.Function):
    """Chunked Bi-WKV with a hand-written backward; see the module docstring for the scheme."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_len: int):
        y, saved, (ctx.T, ctx.L) = chunked_forward(w, u, k, v, chunk_len)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        return *chunked_backward(ctx.saved_tensors, ctx.T, ctx.L, grad_y), None


def check_wkv_inputs(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuses, in one sentence (OpInputError), what the op would misread: k, v (B, T, C) of one shape with T >= 1,
    w, u (C,), every one a floating-point tensor on k's device. Any u is fine (see the module docstring)."""
    op = "Bi-WKV"
    if not isinstance(k, torch.Tensor) or k.dim() != 3:
        got = f"shape {tuple(k.shape)}" if isinstance(k, torch.Tensor) else type(k).__name__
        raise OpInputError(f"{op}: k must be (batch, tokens, channels), got {got}; add the missing dimension "
                           f"(e.g. k[None] for one sequence).")
    check_float(op, k.device, w=w, u=u, k=k, v=v)
    if k.shape[1] == 0:
        raise OpInputError(f"{op}: k has 0 tokens (shape {tuple(k.shape)}); pass at least one token.")
    check_shape(op, "v", v, k.shape, "k's (batch, tokens, channels)")
    check_shape(op, "w", w, k.shape[2:], "(channels,)")
    check_shape(op, "u", u, k.shape[2:], "(channels,)")


# Whether triton can be imported here, found without importing it (the kernels import it on first use).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


@fp32_operator
def bi_wkv(
    w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_len: int = 32, backend: str = "auto"
) -> torch.Tensor:
    """Bi-WKV of k, v (B, T, C) with decay w and bonus u (C,), exact in O(B T C); returns (B, T, C).

    backend: "auto" runs the fused Triton kernels for CUDA tensors in fp32 / bf16 / fp16 when triton is
    installed, and this chunked PyTorch op otherwise; "torch" always takes the chunked op; "triton" always
    takes the kernels (on CPU through Triton's interpreter, TRITON_INTERPRET=1, which is how the tests check
    them). Both go through one torch.library op (backbones/ops/wkv_op.py) under torch.compile, so a compiled
    block has no graph break; in eager mode each path's autograd.Function is called directly (no dispatcher
    work per call, and the chunked backward reuses what its forward computed instead of recomputing it).
    chunk_len (chunked op only) is the longest chunk: the matmul costs O(B T L C) and the carry loop T / L
    steps. It is shortened automatically for very fast decays (|w| chunk_len > 12), see the module docstring.
    """
    if backend not in ("auto", "torch", "triton"):
        raise OpInputError(f"bi_wkv backend={backend!r}: use 'auto', 'torch' or 'triton'.")
    check_wkv_inputs(w, u, k, v)
    out_dtype = torch.promote_types(k.dtype, v.dtype)
    kernels = (torch.float32, torch.bfloat16, torch.float16)
    if backend == "triton" or (backend == "auto" and k.is_cuda and out_dtype in kernels and _HAS_TRITON):
        if out_dtype not in kernels:
            raise OpInputError(f"bi_wkv's Triton kernels take fp32, bf16 or fp16 k and v, got {out_dtype}; use backend='torch'.")
        if k.numel() == 0:
            return torch.zeros_like(k, dtype=out_dtype) + 0 * (w.sum() + u.sum() + k.sum() + v.sum())
        # k and v are read in their own dtype (no fp32 copy in memory); w, u are C floats.
        args = (w.float().contiguous(), u.float().contiguous(), k.to(out_dtype).contiguous(), v.to(out_dtype).contiguous())
        if torch.compiler.is_compiling():
            return wkv_op.bi_wkv_op(*args, chunk_len, True)[0]
        from backbones.ops.wkv_triton import bi_wkv_triton  # imports triton (first call only)

        return bi_wkv_triton(*args)
    dtype = torch.promote_types(out_dtype, torch.float32)
    args = (w.to(dtype), u.to(dtype), k.to(dtype), v.to(dtype))
    if torch.compiler.is_compiling():
        y = wkv_op.bi_wkv_op(*args, chunk_len, False)[0]
    else:
        y = _BiWKV.apply(*args, chunk_len)
    return y.to(out_dtype)


def bi_wkv_reference(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The O(T^2) definition: one (T, T) decay matrix per channel and a batched matmul; (B, T, C) -> (B, T, C)."""
    B, T, C = k.shape
    pos = torch.arange(T, device=k.device)
    dist = (pos[:, None] - pos[None, :]).abs()  # (T, T)
    log_decay = -(dist - 1).to(w.dtype) * w[:, None, None]  # (C, T, T)
    log_decay = torch.where(dist == 0, u[:, None, None], log_decay)
    # The key max cancels between numerator and denominator; subtracting it keeps e^k finite.
    ek = torch.exp(k - k.detach().amax(dim=1, keepdim=True))
    x = torch.stack([ek, ek * v], dim=-1).permute(2, 1, 0, 3)  # (B, T, C, 2) -> (C, T, B, 2)
    y = torch.bmm(torch.exp(log_decay), x.reshape(C, T, B * 2)).view(C, T, B, 2)  # (C, T, B 2) -> (C, T, B, 2)
    return (y[..., 1] / y[..., 0]).permute(2, 1, 0)  # (C, T, B) -> (B, T, C)


# The op calls chunked_forward / chunked_backward above, so it is imported once they exist.
from backbones.ops import wkv_op  # noqa: E402
