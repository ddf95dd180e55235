"""The CUDA selective scan's algorithm (selective_scan_cuda.cu) step for step in torch: its CPU-tested reference.

The kernel runs only on a GPU; this module does the same arithmetic in the same order on any device, so tests
check the algorithm against the definition (`selective_scan_ref`) at odd shapes on a CPU:
- the sequence is cut into chunks of `lanes` x `steps` steps, each lane owning `steps` consecutive steps;
- forward, per chunk and state: a lane composes its steps' maps h -> a h + x serially, the lanes' maps are scanned
  by recursive doubling (the kernel's shuffle-up scan), the chunk's entering state seeds them, and each lane walks
  its steps from the state its left neighbour ends with; the state entering each later chunk is kept;
- backward, chunks in reverse: h_{t-1} recomputed from the kept state; dh_t = a_{t+1} dh_{t+1} + C_t dy_t with
  a_{t+1} taken from the next step of the lane, or from the right lane's first step at the edge, scanned the same
  way right to left; the carry into the previous chunk is a_t dh_t of the chunk's first step; the decay gradient
  is dh_t a_t h_{t-1}. dB and dC sum over a group's channels.
Here the lanes, channels and states are tensor dimensions instead of threads; the step loops are Python loops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunked(t: torch.Tensor, chunks: int, lanes: int, steps: int) -> torch.Tensor:
    """(..., l) -> (..., chunks, lanes, steps), zero past the end."""
    t = F.pad(t, (0, chunks * lanes * steps - t.shape[-1]))
    return t.unflatten(-1, (chunks, lanes, steps))  # (..., lp) -> (..., chunks, lanes, steps)


def _scan_lanes(P: torch.Tensor, Q: torch.Tensor, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of the maps h -> P h + Q along the last (lane) dimension by recursive doubling: lane i
    composes with the lane `off` to its left (right if `reverse`) for off = 1, 2, 4, ...; lanes with no such
    neighbour compose with the identity (1, 0)."""
    lanes, off = P.shape[-1], 1
    while off < lanes:
        if reverse:  # neighbour at lane + off
            p, q = F.pad(P[..., off:], (0, off), value=1.0), F.pad(Q[..., off:], (0, off))
        else:  # neighbour at lane - off
            p, q = F.pad(P[..., :-off], (off, 0), value=1.0), F.pad(Q[..., :-off], (off, 0))
        Q, P = P * q + Q, P * p
        off *= 2
    return P, Q


def _inputs(u, delta, A, B, C, delta_bias, delta_softplus, lanes, steps):
    """The compute dtype's step sizes, B, C per channel, and everything cut into (chunks, lanes, steps)."""
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    b, d, l = u.shape
    if B.dim() == 3:
        B, C = B[:, None], C[:, None]  # (b, n, l) -> (b, 1, n, l)
    k = d // B.shape[1]
    raw = delta.to(compute) + (delta_bias.to(compute)[:, None] if delta_bias is not None else 0)
    dt = F.softplus(raw) if delta_softplus else raw
    chunks = -(-l // (lanes * steps))
    cut = lambda t: _chunked(t.to(compute), chunks, lanes, steps)  # noqa: E731
    # Zero step sizes past the end (after softplus): a = 1 and x = 0 there leave h unchanged.
    u_c, raw_c, dt_c = cut(u)[:, :, None], cut(raw)[:, :, None], cut(dt)[:, :, None]  # (b, d, 1, chunks, lanes, steps)
    # (b, g, n, l) -> (b, d, n, chunks, lanes, steps): channel c reads group c // k.
    B_c, C_c = (cut(t).repeat_interleave(k, dim=1) for t in (B, C))
    a = torch.exp(dt_c * A.to(compute)[:, :, None, None, None])  # (b, d, n, chunks, lanes, steps)
    return compute, chunks, u_c, raw_c, dt_c, B_c, C_c, a


def _recompute_h(a_c, x_c, h_in):
    """One chunk's states before each step (h_{t-1}) and the state after it, from the entering state h_in (b, d, n).

    a_c, x_c: (b, d, n, lanes, steps). Returns hp (b, d, n, lanes, steps) and the chunk's last state (b, d, n).
    """
    steps = a_c.shape[-1]
    P, Q = torch.ones_like(h_in)[..., None], torch.zeros_like(x_c[..., 0])
    for i in range(steps):  # the lane's own steps, composed serially
        Q, P = a_c[..., i] * Q + x_c[..., i], P * a_c[..., i]
    P, Q = _scan_lanes(P, Q, reverse=False)
    h_end = P * h_in[..., None] + Q  # state after each lane's last step
    h = torch.cat([h_in[..., None], h_end[..., :-1]], -1)  # entering each lane: its left neighbour's last
    hp = torch.empty_like(x_c)
    for i in range(steps):
        hp[..., i] = h
        h = a_c[..., i] * h + x_c[..., i]
    return hp, h_end[..., -1]


def lane_scan_forward(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, lanes=32, steps=8):
    """out (u's dtype) and the states entering each chunk after the first, (b, d, chunks - 1, n)."""
    compute, chunks, u_c, _, dt_c, B_c, C_c, a = _inputs(u, delta, A, B, C, delta_bias, delta_softplus, lanes, steps)
    b, d, l = u.shape
    x = dt_c * u_c * B_c
    h_in = x.new_zeros(b, d, A.shape[1])
    y = torch.zeros_like(u_c[:, :, 0])  # (b, d, chunks, lanes, steps)
    states = []
    for c in range(chunks):
        hp, h_last = _recompute_h(a[..., c, :, :], x[..., c, :, :], h_in)
        # h_t = a_t h_{t-1} + x_t, read out by C_t.
        y[..., c, :, :] = (C_c[..., c, :, :] * (a[..., c, :, :] * hp + x[..., c, :, :])).sum(2)
        h_in = h_last
        if c + 1 < chunks:
            states.append(h_in)
    u32 = u.to(compute)
    y = y.flatten(2)[..., :l]  # (b, d, chunks, lanes, steps) -> (b, d, l)
    if D is not None:
        y = y + D.to(compute)[:, None] * u32
    if z is not None:
        y = y * F.silu(z.to(compute))
    stacked = torch.stack(states, 2) if states else y.new_zeros(b, d, 0, A.shape[1])  # (b, d, chunks - 1, n)
    return y.to(u.dtype), stacked


def lane_scan_backward(dout, u, delta, A, B, C, D, z, delta_bias, delta_softplus, states, lanes=32, steps=8):
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, dbias) in the compute dtype, shaped as the inputs; None if absent."""
    compute, chunks, u_c, raw_c, dt_c, B_c, C_c, a = _inputs(u, delta, A, B, C, delta_bias, delta_softplus, lanes, steps)
    b, d, l = u.shape
    n = A.shape[1]
    A32 = A.to(compute)
    grouped = B.dim() == 4
    g = B.shape[1] if grouped else 1
    gate = F.silu(z.to(compute)) if z is not None else 1.0
    dy = _chunked(dout.to(compute) * gate, chunks, lanes, steps)[:, :, None]  # (b, d, 1, chunks, lanes, steps)
    x = dt_c * u_c * B_c
    dx, ddt, y = (torch.zeros_like(u_c[:, :, 0]) for _ in range(3))  # (b, d, chunks, lanes, steps)
    dA = A32.new_zeros(b, d, n)
    dB_d, dC_d = torch.zeros_like(B_c), torch.zeros_like(C_c)  # per channel, summed over each group's below
    right = x.new_zeros(b, d, n)  # a_{t+1} dh_{t+1} at the first step of the chunk after
    for c in range(chunks - 1, -1, -1):
        a_c, x_c, B_k, C_k = (t[..., c, :, :] for t in (a, x, B_c, C_c))
        dy_c, dt_k, u_k = (t[..., c, :, :] for t in (dy, dt_c, u_c))
        h_in = states[:, :, c - 1].to(compute) if c > 0 else torch.zeros_like(right)
        hp, _ = _recompute_h(a_c, x_c, h_in)
        h = a_c * hp + x_c  # h_t, (b, d, n, lanes, steps)
        # a_{t+1}: the next step in the lane, the right lane's first step at the edge, 1 at the chunk's end (the
        # carry `right` already holds a_{t+1} dh_{t+1} there).
        edge = F.pad(a_c[..., 1:, 0], (0, 1), value=1.0)  # (b, d, n, lanes)
        an = torch.cat([a_c[..., 1:], edge[..., None]], -1)  # (b, d, n, lanes, steps)
        cy = C_k * dy_c
        P, Q = torch.ones_like(edge), torch.zeros_like(edge)
        for i in range(steps - 1, -1, -1):
            Q, P = an[..., i] * Q + cy[..., i], P * an[..., i]
        P, Q = _scan_lanes(P, Q, reverse=True)
        # dh of each lane's right neighbour's first step; the last lane's right is the carry.
        dh = torch.cat([(P * right[..., None] + Q)[..., 1:], right[..., None]], -1)
        for i in range(steps - 1, -1, -1):
            dh = an[..., i] * dh + cy[..., i]
            dx[..., c, :, i] += (dh * B_k[..., i]).sum(2)
            decay = dh * a_c[..., i] * hp[..., i]  # d(delta_t A) = dh_t a_t h_{t-1}
            ddt[..., c, :, i] += (decay * A32[:, :, None]).sum(2)
            dA += (decay * dt_k[..., i]).sum(-1)
            dB_d[..., c, :, i] = dh * dt_k[..., i] * u_k[..., i]
            dC_d[..., c, :, i] = dy_c[..., i] * h[..., i]
        right = a_c[..., 0, 0] * dh[..., 0]
        if z is not None:
            y[..., c, :, :] = (C_k * h).sum(2)

    def to_bdl(t):
        return t.flatten(2)[..., :l]  # (b, d, chunks, lanes, steps) -> (b, d, l)

    u32, dy_l, dx_l = u.to(compute), to_bdl(dy[:, :, 0]), to_bdl(dx)
    dt_l, raw_l = to_bdl(dt_c[:, :, 0]), to_bdl(raw_c[:, :, 0])
    du = dx_l * dt_l + (dy_l * D.to(compute)[:, None] if D is not None else 0)
    ddelta = dx_l * u32 + to_bdl(ddt)
    if delta_softplus:
        ddelta = ddelta * torch.sigmoid(raw_l)
    dz = None
    if z is not None:
        z32 = z.to(compute)
        s = torch.sigmoid(z32)
        pre = to_bdl(y) + (D.to(compute)[:, None] * u32 if D is not None else 0)
        dz = dout.to(compute) * pre * s * (1 + z32 * (1 - s))
    # dB, dC: (b, d, n, chunks, lanes, steps) summed over each group's channels -> (b, g, n, l).
    dB, dC = (t.flatten(3)[..., :l].unflatten(1, (g, d // g)).sum(2) for t in (dB_d, dC_d))
    if not grouped:
        dB, dC = dB[:, 0], dC[:, 0]  # (b, 1, n, l) -> (b, n, l)
    dD = (dy_l * u32).sum((0, 2)) if D is not None else None
    dbias = ddelta.sum((0, 2)) if delta_bias is not None else None
    return du, ddelta, dA.sum(0), dB, dC, dD, dz, dbias
