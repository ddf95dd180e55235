"""Mamba-2's scan (SSD: a scalar decay per head) as chunked matrix products, and its sequential reference.

Per head, with state H_t of shape (p, n):
    H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T,   y_t = H_t C_t + D x_t
x: (b, l, h, p); dt: (b, l, h) (after softplus); A, D: (h,); B, C: (b, l, g, n) with head i using group
i // (h // g).

Because the decay is one scalar per head and step, the chunk-local part is an attention-like matrix
product (Dao & Gu 2024, the "SSD" algorithm), which suits CPUs: inside a chunk of T steps,
y_t += sum_{s<=t} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s with cum the running sum of dt A; states are
passed between chunks by a short sequential loop. Every exponent is a difference cum_t - cum_s with s <= t,
hence <= 0 (entries with s > t are masked to -inf before exp), so nothing overflows; nothing is divided.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backbones.ops.autocast import fp32_operator


def _check(x: torch.Tensor, B: torch.Tensor) -> int:
    """Heads per group of B and C."""
    h, g = x.shape[2], B.shape[2]
    if h % g:
        raise ValueError(f"heads h={h} are not divisible by the {g} groups of B and C")
    return h // g


@fp32_operator
def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Chunked SSD scan (autograd through matmuls); computes in fp32 (fp64 for fp64 x), returns x's dtype."""
    heads_per_group = _check(x, B)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_c, dt, A, B, C = (t.to(compute) for t in (x, dt, A, B, C))
    b, l, h, p = x.shape
    T = min(chunk_size, l)
    nc = -(-l // T)
    # Zero step sizes pad to whole chunks: no decay and no input there, so real steps are unaffected.
    pad = nc * T - l
    x_p, dt_p = F.pad(x_c, (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
    # (b, l, g, n) -> (b, lp, h, n)
    B_p, C_p = (F.pad(t, (0, 0, 0, 0, 0, pad)).repeat_interleave(heads_per_group, dim=2) for t in (B, C))
    x_p = x_p.view(b, nc, T, h, p)  # (b, lp, h, p) -> (b, nc, T, h, p)
    B_p, C_p = (t.view(b, nc, T, h, -1) for t in (B_p, C_p))  # (b, lp, h, n) -> (b, nc, T, h, n)
    dt_p = dt_p.view(b, nc, T, h)  # (b, lp, h) -> (b, nc, T, h)

    # Running log-decay inside each chunk, cum_t = sum_{s<=t} dt_s A <= 0.
    cum = torch.cumsum(dt_p * A, dim=2).permute(0, 1, 3, 2)  # (b, nc, T, h) -> (b, nc, h, T)
    # Chunk-local mixing matrix L[t, s] = exp(cum_t - cum_s) for s <= t, else 0.
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    L = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))  # (b, nc, h, T, T)
    u = x_p * dt_p[..., None]  # dt_s x_s, (b, nc, T, h, p)

    # Within-chunk outputs: an attention-like product with the decay mask.
    scores = torch.einsum("bcthn,bcshn->bchts", C_p, B_p) * L
    y = torch.einsum("bchts,bcshp->bcthp", scores, u)

    # State each chunk adds by its end: sum_s exp(cum_last - cum_s) dt_s x_s B_s^T.
    to_end = torch.exp(cum[..., -1:] - cum)  # (b, nc, h, T)
    chunk_states = torch.einsum("bcht,bcthp,bcthn->bchpn", to_end, u, B_p)

    # Pass states across chunks sequentially; states[c] is the state entering chunk c.
    chunk_decay = torch.exp(cum[..., -1])  # (b, nc, h)
    state = chunk_states.new_zeros(b, h, p, chunk_states.shape[-1])
    entering = []
    for c in range(nc):
        entering.append(state)
        state = chunk_decay[:, c, :, None, None] * state + chunk_states[:, c]
    states = torch.stack(entering, dim=1)  # nc x (b, h, p, n) -> (b, nc, h, p, n)

    # Contribution of the entering state, decayed to each step: exp(cum_t) C_t . H.
    y = y + torch.einsum("bcthn,bchpn,bcht->bcthp", C_p, states, torch.exp(cum))
    y = y.reshape(b, nc * T, h, p)[:, :l]  # (b, nc, T, h, p) -> (b, l, h, p)
    if D is not None:
        y = y + D.to(compute)[:, None] * x_c
    return y.to(x.dtype)


def ssd_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> torch.Tensor:
    """The definition, one time step at a time; for tests."""
    heads_per_group = _check(x, B)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_c, dt, A, B, C = (t.to(compute) for t in (x, dt, A, B, C))
    B, C = (t.repeat_interleave(heads_per_group, dim=2) for t in (B, C))  # (b, l, g, n) -> (b, l, h, n)
    b, l, h, p = x.shape
    state = x_c.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for x_s, dt_s, B_s, C_s in zip(x_c.unbind(1), dt.unbind(1), B.unbind(1), C.unbind(1)):
        state = torch.exp(dt_s * A)[..., None, None] * state + (dt_s[..., None] * x_s)[..., None] * B_s[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C_s))
    y = torch.stack(ys, dim=1)  # l x (b, h, p) -> (b, l, h, p)
    if D is not None:
        y = y + D.to(compute)[:, None] * x_c
    return y.to(x.dtype)
