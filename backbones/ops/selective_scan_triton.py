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
(a multiple of every BLOCK_D), walks them BLOCK_D at a time and adds each block's sums into its own (n, l)
partial row (L2-resident); torch sums the b * d / CPP partials. The walk is a serial chain of
CPP / BLOCK_D x n x 2 tile scans, and on the H100 that chain, not bytes, was the backward's time: 2.55 ms at
CPP 64 (768 programs of 32 blocks, docs/gpu/h100-2026-11-26c). At one 8-warp program per SM (the 256-step
configs) fewer channels per program leave each SM's chain as long as it was; with short chunks on 1-2 warps (below)
about 13 programs share an SM, and CPP 8-16 gives them the programs to do so, at the price of more partial rows (at
CPP 8 the dB, dC partials are 4 bytes x n / 8 per (b, d, l) element each). So CPP is tuned, among 8, 16 and 64,
keeping those that leave at most 8,192
programs (`backward_cpps`); the partial buffer has the slots of the smallest kept CPP and torch sums the slots
the picked config wrote (`bwd_kernel.best_config`). The batch size is in the tuning key, since the kept CPPs
depend on it.

Autotune: forward chooses BLOCK_D and num_warps on first use per (d, l, n, flags, dtypes), backward BLOCK_D 2
at 8 warps or BLOCK_D 4 at 4 or 16, each at every kept CPP: the block configs that compile for sm_90 without
register spills at CHUNK 256 as the JIT builds them at launch (`python -m train.bench.kernel_compile` prints
registers, spills, shuffles and barriers of every config). After the first call per shape, flags and dtypes
each kernel is launched with the config it picked, without its autotuner (backbones/ops/triton_launch.py). CHUNK is fixed by the shape, so the states forward stores never depend on the tuned config.
Under TRITON_INTERPRET=1 each kernel has one small config.

Precision: fp32 state and sums for fp32 / bf16 / fp16 inputs (loaded in their dtype, widened in
registers); fp64 inputs compute in fp64 (exp instead of exp2). Output in u's dtype, each gradient in
its input's dtype. Stability: with delta >= 0 and A < 0 every factor is in (0, 1]; nothing is divided.
"""

from __future__ import annotations

import os

import torch
import triton
from torch.autograd.function import once_differentiable
from triton.runtime.interpreter import InterpretedFunction

from backbones.ops.autocast import fp32_operator
from backbones.ops.op_inputs import OpInputError
from backbones.ops.selective_scan import check_scan_inputs
from backbones.ops.triton_launch import launch
from routing.errors import ConfigError
# The @triton.jit kernels live beside this file; the combine functions are re-exported for the tests.
from backbones.ops.selective_scan_triton_kernels import _compose, _compose_pre, _scan_bwd_kernel, _scan_fwd_kernel  # noqa: F401

# Steps per chunk, the most: a (BLOCK_D, 256) tile per live value keeps forward's live tiles within registers
# for BLOCK_D <= 4 and backward's ~20 for BLOCK_D <= 2 (ptxas, sm_90), and 256 tokens (the project's usual
# sequence) take one chunk. TREAD_SCAN_CHUNK=16..256 sets another (`max_chunk`): chunks of 64 or fewer run on 1-2
# warps (SHORT_* configs), so a tile's scan stays inside a warp, with no barrier, and 13 or more programs share an SM.
# The H100 measured the 256-step kernel's backward at one 8-warp program per SM, bound by the barriers of its scans
# (docs/gpu/h100-2026-11-26c); the short chunks are the alternative, not yet timed on a GPU.
MAX_CHUNK = 256
CHUNKS = (16, 32, 64, 128, 256)
SHORT_CHUNK = 64  # the longest chunk that the SHORT_* configs are for
# Backward's channels per program (CPP), tuned: 64 was the fixed pick the H100 measured (768 programs at the
# reference shape), 8 and 16 walk a shorter chain in 8x and 4x the programs. More than 8,192 programs (~62 per SM)
# only adds partial rows: the walk is no longer the chain that bounds the kernel there.
BWD_CPP = (8, 16, 64)
_MAX_BWD_PROGRAMS = 8192


# Under TRITON_INTERPRET=1 (read when the kernels are decorated) they run on CPU tensors, through numpy.
_INTERPRETED = isinstance(_scan_fwd_kernel, InterpretedFunction)


def _configs(shapes: tuple[tuple[int, int], ...], cpps: tuple[int, ...] = (), budgets: dict | None = None) -> list[triton.Config]:
    """(BLOCK_D, num_warps) pairs as autotune configs, each at every CPP given (backward's channels per program), with
    the register budget `budgets` gives the pair (FWD_MAXNREG, BWD_MAXNREG)."""
    if _INTERPRETED:  # the interpreter would run every config; one small one exercises the same code (CPP 8: two blocks)
        return [triton.Config({"BLOCK_D": 4, **({"CPP": cpps[0]} if cpps else {})}, num_warps=1)]
    return [triton.Config({"BLOCK_D": bd, **({"CPP": c} if c else {})}, num_warps=w, maxnreg=(budgets or {}).get((bd, w)))
            for bd, w in shapes for c in cpps or (None,)]


# Keyed on the shape and the flags; the autotuner adds every tensor argument's dtype to the key itself.
_KEY = ["d", "g", "L", "N", "HAS_D", "HAS_Z", "HAS_BIAS", "CHUNK"]
_BWD_KEY = ["batch", *_KEY]  # the CPPs backward may pick depend on the batch (`backward_cpps`)
# Every shipped config compiles for sm_90 without register spills as the JIT builds it at launch, in fp32 and bf16, at
# the reference shape b64 d768 L256 N16 with every flag set and at L 1,024, 4,096 and 16,384 with the batch keeping
# 16,384 tokens and the Mamba block's flags (`python -m train.bench.kernel_compile --kernels scan [--lengths ...]`,
# Triton 3.8; docs/performance.md has every count). At 4 and 8 warps, forward BLOCK_D 8 and 16 spill 52-688 bytes per thread (an unspecialised build,
# ptxas 12.9); backward BLOCK_D 2 at 8 warps takes 128 registers, BLOCK_D 4 at 4 warps 195-255 and at 16 warps
# 112-128. With Triton 3.6 (the H100 image) the 16-warp tiles spilled 4-32 bytes. The one H100 run
# (docs/gpu/h100-2026-11-26b) found both kernels bound by the latency of many small tile scans, so the larger tiles are
# candidates the autotuner times, not a measured improvement. BLOCK_D must divide every CPP (>= 8) in backward.
FWD_CONFIGS = ((2, 4), (4, 4), (4, 8), (8, 16))  # (BLOCK_D, num_warps) on a GPU, chunks of 128 and 256
BWD_CONFIGS = ((2, 8), (4, 4), (4, 16))
# Chunks of <= 64 steps on 1-2 warps, built as launched at CHUNK 64: forward 61-124 registers, no spill. Backward
# BLOCK_D 1 at 1 warp spilled 16 bytes (unspecialised), so it is not a candidate.
SHORT_FWD_CONFIGS = ((1, 1), (2, 1), (4, 2))
SHORT_BWD_CONFIGS = ((2, 1), (2, 2))
# Registers per thread ptxas may use (`.maxnreg`), by (BLOCK_D, num_warps); unset, ptxas picks. Left to itself it held
# some blocks below what they need and spilled: backward BLOCK_D 2 at 1 warp at 128 registers, spilling 8-28 bytes (at
# 64-step chunks: fp32 with any flags, bf16 at batch 1), at 2 warps at 96 (4-8 bytes: fp32, or bf16 without z), at 8
# warps at 128 (8-16 bytes: bf16 over more than one chunk with z, or at batch 1); forward BLOCK_D 8 at 16 warps at 64
# (12 bytes: fp32 without D, z or bias, over more than one chunk). Given a budget it allocates afresh and none spills:
# backward at 1 warp 147-160 registers (12 programs per SM), at 2 warps and at 8 at most 128 (8 and 2 programs, as
# before); forward at 16 warps at most 90 (128 is that size's ceiling anyway). Each budget is the smallest of 128, 160
# and 192 without a spill in any build compiled (docs/performance.md: the reference shape with every flag set, the
# scaling lengths with the Mamba block's, fp32 and bf16).
FWD_MAXNREG = {(8, 16): 128}
BWD_MAXNREG = {(2, 1): 160, (2, 2): 128, (2, 8): 128}


def _for_chunk(configs: list[triton.Config], chunk: int, short: tuple, wide: tuple) -> list[triton.Config]:
    """The configs made for this chunk length: `short` (BLOCK_D, num_warps) pairs up to SHORT_CHUNK, else `wide`."""
    allowed = short if chunk <= SHORT_CHUNK else wide
    return [c for c in configs if (c.kwargs["BLOCK_D"], c.num_warps) in allowed]


def _prune_forward(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    return _for_chunk(configs, kwargs["CHUNK"], SHORT_FWD_CONFIGS, FWD_CONFIGS)


def _prune_backward(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The backward configs for this chunk and shape: the chunk's own block configs at the CPPs `backward_cpps` keeps."""
    cpps = backward_cpps(named_args["batch"], named_args["g"], named_args["d"] // named_args["g"])
    return [c for c in _for_chunk(configs, kwargs["CHUNK"], SHORT_BWD_CONFIGS, BWD_CONFIGS) if c.kwargs["CPP"] in cpps]


fwd_kernel = triton.autotune(configs=_configs(FWD_CONFIGS + SHORT_FWD_CONFIGS, (), FWD_MAXNREG), key=_KEY,
                             prune_configs_by={"early_config_prune": _prune_forward})(_scan_fwd_kernel)
bwd_kernel = triton.autotune(configs=_configs(BWD_CONFIGS + SHORT_BWD_CONFIGS, BWD_CPP, BWD_MAXNREG), key=_BWD_KEY,
                             prune_configs_by={"early_config_prune": _prune_backward})(_scan_bwd_kernel)


def max_chunk() -> int:
    """The longest chunk: TREAD_SCAN_CHUNK when set (one of CHUNKS), else MAX_CHUNK."""
    value = os.environ.get("TREAD_SCAN_CHUNK")
    if value is None:
        return MAX_CHUNK
    if value not in {str(c) for c in CHUNKS}:
        raise ConfigError(f"TREAD_SCAN_CHUNK={value!r} is not a chunk length the selective scan takes; use one of "
                          f"{', '.join(map(str, CHUNKS))}, or unset it for {MAX_CHUNK}.")
    return int(value)


def time_chunk(length: int) -> int:
    """Steps per chunk: the sequence rounded up to a power of two (at least 16), at most `max_chunk()`."""
    return min(max_chunk(), max(16, triton.next_power_of_2(length)))


def backward_cpps(b: int, g: int, k: int) -> tuple[int, ...]:
    """The channels per backward program the autotuner may pick for b batch rows, g groups of k channels: the
    BWD_CPP that leave at most _MAX_BWD_PROGRAMS programs and are no wider than the group (the smallest always
    is), or the largest alone when none does. Under the interpreter, its one config's CPP."""
    if _INTERPRETED:
        return (bwd_kernel.configs[0].kwargs["CPP"],)
    fit = tuple(c for c in BWD_CPP if b * g * triton.cdiv(k, c) <= _MAX_BWD_PROGRAMS and (c <= k or c == BWD_CPP[0]))
    return fit or (BWD_CPP[-1],)


def states_shape(b: int, d: int, length: int, n: int) -> tuple[int, int, int, int]:
    """Shape of the chunk states forward keeps for backward: (b, d, chunks - 1, n)."""
    return b, d, triton.cdiv(length, time_chunk(length)) - 1, n


def _dtypes(*tensors) -> tuple:
    """The dtypes of the given tensors (None: absent), part of every launch's config key."""
    return tuple(t.dtype if t is not None else None for t in tensors)


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
    flags = _flags(A, D, z, delta_bias, delta_softplus)
    key = (d, g, length, n, chunk, store, *flags.values(), *_dtypes(u, delta, A, B, C, D, z, delta_bias), u.device)
    launch(
        fwd_kernel, key, grid,
        u, delta, A, B, C, absent if D is None else D, absent if z is None else z,
        absent if delta_bias is None else delta_bias, out, states if states.numel() else absent,
        d, g, length, n, n_chunks, **flags,
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
    k = d // g
    slots = triton.cdiv(k, min(backward_cpps(b, g, k)))  # partial rows per (b, g) at the smallest CPP it may pick
    acc = A.dtype
    du, ddelta = torch.empty_like(u), torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else None
    # Sums still to be taken by torch: over the batch (A, D, delta_bias) and over channel super-blocks (B, C). D's and
    # delta_bias's partials share one buffer, and B's and C's, so each pair is one reduction (and one cast).
    dA = u.new_empty(b, d, n, dtype=acc)
    d_skip = u.new_empty(2, b, d, dtype=acc)  # [dD, dbias] per batch element
    dD = d_skip[0] if D is not None else None
    dbias = d_skip[1] if delta_bias is not None else None
    d_bc = u.new_empty(2, b, g, slots, n, length, dtype=acc)  # [dB, dC] partial rows
    dB, dC = d_bc[0], d_bc[1]
    absent = A
    grid = lambda meta: (g * triton.cdiv(k, meta["CPP"]), b)  # noqa: E731
    flags = _flags(A, D, z, delta_bias, delta_softplus)
    # Everything the autotuner keys on and its pruner reads (the batch, every flag), and the dtypes.
    key = (b, d, g, length, n, chunk, *flags.values(), *_dtypes(u, delta, A, B, C, D, z, delta_bias, dout), u.device)
    config = launch(
        bwd_kernel, key, grid,
        u, delta, A, B, C, absent if D is None else D, absent if z is None else z,
        absent if delta_bias is None else delta_bias, dout.contiguous(), states if states.numel() else absent,
        du, ddelta, absent if dz is None else dz, dA, dB, dC, absent if dD is None else dD,
        absent if dbias is None else dbias,
        b, d, g, length, n, triton.cdiv(length, chunk), slots, **flags,
        BLOCK_N=triton.next_power_of_2(n), CHUNK=chunk,
    )
    parts = triton.cdiv(k, config.kwargs["CPP"])  # the slots the config that ran wrote
    d_bc = d_bc[:, :, :, :parts].sum(3)  # (2, b, g, parts, n, l) -> (2, b, g, n, l)
    dB, dC = d_bc.to(B.dtype).unbind(0) if B.dtype == C.dtype else (d_bc[0].to(B.dtype), d_bc[1].to(C.dtype))
    if D is not None or delta_bias is not None:
        d_skip = (d_skip if D is not None and delta_bias is not None else d_skip[:1] if D is not None else d_skip[1:])
        sums = iter(d_skip.sum(1).unbind(0))  # (2 or 1, b, d) -> d-vectors
        dD = next(sums) if D is not None else None
        dbias = next(sums) if delta_bias is not None else None
    return du, ddelta, dA.sum(0), dB, dC, dD, dz, dbias


def prepare(u, delta, A, B, C, D=None, z=None, delta_bias=None):
    """Checks shapes and device; returns the kernels' inputs: contiguous, B and C grouped (b, g, n, l),
    A / D / delta_bias in the compute dtype (fp32, or fp64 for fp64 u)."""
    check_scan_inputs(u, delta, A, B, C, D, z, delta_bias)
    if not (u.is_cuda or _INTERPRETED):
        raise OpInputError("selective_scan_triton needs CUDA tensors (or TRITON_INTERPRET=1 set before import, "
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
