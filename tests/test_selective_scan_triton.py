"""The Triton selective scan against the sequential definition: values and the gradients of every input.

The tensors live on the GPU when there is one (the compiled kernels run) and on the CPU otherwise, where
the kernels run under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before anything imports
them). Triton ships with torch, so a failing import fails these tests.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from backbones.ops import cuda_kernels
from backbones.ops import selective_scan_triton as sst
from backbones.ops.selective_scan import selective_scan_ref
from backbones.ops.selective_scan_triton import selective_scan_triton

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


@pytest.fixture
def device() -> str:
    """CUDA when present (the compiled kernel only takes CUDA tensors), else the CPU under the interpreter."""
    if torch.cuda.is_available():
        return "cuda"
    assert sst._INTERPRETED, "no GPU and no TRITON_INTERPRET=1: conftest.py should have set it"
    return "cpu"


def _doubling_scan(self, inputs):
    """The interpreter's ScanOps.generic_scan by recursive doubling (Hillis-Steele) on whole slices.

    Triton's interpreter applies a custom combine function element by element in Python (about 40 us
    each), which would make this file take minutes. This applies the same combine function, earlier
    segment first, to whole tensors log2(length) times; it rounds like a parallel scan on a GPU rather
    than the interpreter's sequential order. test_doubling_scan_equals_the_interpreters checks it.
    """
    planes = [np.moveaxis(t.handle.data, self.axis, 0) for t in inputs]  # scanned axis first
    length, shift = planes[0].shape[0], 1
    while shift < length:
        # Row j combines with row j - shift; the first `shift` rows are final (their partners are discarded).
        earlier = [self.to_tensor(np.concatenate([p[:shift], p[:-shift]]), t.dtype) for p, t in zip(planes, inputs)]
        later = [self.to_tensor(np.ascontiguousarray(p), t.dtype) for p, t in zip(planes, inputs)]
        ret = self.combine_fn.fn(*earlier, *later)
        ret = ret if isinstance(ret, tuple) else (ret,)
        planes = [np.concatenate([p[:shift], r.handle.data[shift:]]) for p, r in zip(planes, ret)]
        shift *= 2
    return [self.to_tensor(np.ascontiguousarray(np.moveaxis(p, 0, self.axis)), t.dtype) for p, t in zip(planes, inputs)]


if sst._INTERPRETED:
    from triton.runtime.interpreter import ScanOps as _ScanOps

    _ORIGINAL_GENERIC_SCAN = _ScanOps.generic_scan


def _float_sum(input, axis=None, keep_dims=False, dtype=None):
    """tl.sum for float tiles as a plain function: the interpreter re-patches triton.language on every call of
    a @jit helper such as tl.sum (~3 ms each, most of these tests' time); this reduces the same way (np.sum)."""
    import triton.language as tl

    return tl.reduce(input, axis, tl.standard._sum_combine, keep_dims=keep_dims)


@pytest.fixture(autouse=True)
def fast_interpreter_scan(monkeypatch):
    if sst._INTERPRETED:
        import triton.language as tl
        from triton.runtime.interpreter import ScanOps

        monkeypatch.setattr(ScanOps, "generic_scan", _doubling_scan)
        monkeypatch.setattr(tl, "sum", _float_sum)


@pytest.mark.skipif(not sst._INTERPRETED, reason="on a GPU the compiled kernels run and nothing is patched")
@pytest.mark.parametrize("combine", ["affine", "affine_pre"])
def test_doubling_scan_equals_the_interpreters(combine):
    """The speed-up above must compute what the interpreter computes (forward and reverse, 2 and 3 operands)."""
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import ScanOps

    @triton.jit
    def scan_kernel(a_ptr, x_ptr, s_ptr, out_ptr, REVERSE: tl.constexpr, PRE: tl.constexpr):
        idx = tl.arange(0, 2)[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        a, x = tl.load(a_ptr + idx), tl.load(x_ptr + idx)
        if PRE:
            _, _, h = tl.associative_scan((a, x, tl.load(s_ptr + idx)), 2, sst._compose_pre, reverse=REVERSE)
        else:
            _, h = tl.associative_scan((a, x), 2, sst._compose, reverse=REVERSE)
        tl.store(out_ptr + idx, h)

    g = torch.Generator().manual_seed(0)
    a, x, s = torch.rand(2, 4, 8, generator=g, dtype=torch.float64), *torch.randn(2, 2, 4, 8, generator=g, dtype=torch.float64)
    pre = combine == "affine_pre"
    for reverse in (False, True):
        fast, slow = torch.empty_like(x), torch.empty_like(x)
        scan_kernel[(1,)](a, x, s, fast, reverse, pre)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ScanOps, "generic_scan", _ORIGINAL_GENERIC_SCAN)  # element by element
            scan_kernel[(1,)](a, x, s, slow, reverse, pre)
        torch.testing.assert_close(fast, slow, rtol=1e-14, atol=1e-14)
        # And both are the recurrence h_t = a_t h_{t-1} + x_t (h_{t+1} when reversed); with PRE the third
        # output, a_t h_{t-1} + s_t, is the state before step t's input (the kernel passes s = 0 but at the start).
        h, expected = torch.zeros(2, 4, dtype=torch.float64), torch.empty_like(x)
        order = range(7, -1, -1) if reverse else range(8)
        for t in order:
            expected[..., t] = a[..., t] * h + (s[..., t] if pre else x[..., t])
            h = a[..., t] * h + x[..., t]
        torch.testing.assert_close(fast, expected)


def _inputs(b, d, length, n, dtype, device, groups=None, seed=0):
    """Random inputs in mamba-ssm's layout; A < 0; delta raw (softplus makes it positive)."""
    g = torch.Generator().manual_seed(seed)
    bc_shape = (b, groups, n, length) if groups else (b, n, length)
    tensors = dict(
        u=torch.randn(b, d, length, generator=g),
        delta=torch.randn(b, d, length, generator=g) * 0.5,
        A=-(torch.rand(d, n, generator=g) * 2 + 0.1),
        B=torch.randn(*bc_shape, generator=g),
        C=torch.randn(*bc_shape, generator=g),
        D=torch.randn(d, generator=g),
        z=torch.randn(b, d, length, generator=g),
        delta_bias=torch.randn(d, generator=g) * 0.3,
    )
    return {k: v.to(device, dtype) for k, v in tensors.items()}


def _value_and_grads(fn, inputs: dict, softplus: bool = True, drop: tuple[str, ...] = ()):
    """fn's output and the gradients of every input it takes (None-ed names in `drop` are left out)."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items() if k not in drop}
    y = fn(**leaves, delta_softplus=softplus)
    gy = torch.cos(torch.arange(y.numel(), device=y.device, dtype=torch.float64)).view_as(y).to(y.dtype)
    grads = torch.autograd.grad(y, list(leaves.values()), gy)
    return y, dict(zip(leaves, grads))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest error relative to the largest magnitude of the reference."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _check(inputs, tol, softplus=True, drop=(), ref_inputs=None):
    y, grads = _value_and_grads(selective_scan_triton, inputs, softplus, drop)
    y_ref, grads_ref = _value_and_grads(selective_scan_ref, ref_inputs or inputs, softplus, drop)
    assert y.dtype == inputs["u"].dtype
    assert _rel(y, y_ref) < tol, "out"
    assert set(grads) == set(NAMES) - set(drop)
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, name
        assert _rel(grad, grads_ref[name]) < tol, name


# Each d, length and n with each other value of the others at least once (the interpreter is slow: few cases).
@pytest.mark.parametrize("d,length,n", [(3, 1, 4), (3, 9, 16), (3, 40, 4), (20, 1, 16), (20, 9, 4), (20, 40, 16)])
def test_float64_matches_definition(device, d, length, n):
    """The algebra, forward and backward, exactly: fp64 in, fp64 state, against the sequential loop.

    d = 20 in the interpreter's config (BLOCK_D = 4, 8 channels per backward program) also walks two
    channel blocks per backward program, the second adding into the dB, dC partial rows the first wrote."""
    _check(_inputs(2, d, length, n, torch.float64, device), tol=1e-10)


@pytest.mark.parametrize("length", [1, 17, 300])
def test_odd_lengths_and_partial_channel_blocks(device, length):
    """Lengths that are not a multiple of 16 (on a GPU the JIT builds those without the divisibility hint on L, another
    layout: selective_scan_triton_kernels._SHAPE_ARGS), 300 = a 256-step chunk and a padded 44-step one, and d = 6:
    the last channel block (BLOCK_D 4) and the backward's walk over CPP 8 channels half empty."""
    _check(_inputs(2, 6, length, 4, torch.float64, device), tol=1e-10)


@pytest.mark.parametrize("d,length,n", [(3, 40, 4), (20, 24, 16)])
def test_float32_within_state_tolerance(device, d, length, n):
    """fp32 kernel vs the fp64 definition on the same values: 1e-5 of the largest magnitude."""
    inputs = _inputs(2, d, length, n, torch.float32, device)
    _check(inputs, tol=1e-5, ref_inputs={k: v.double() for k, v in inputs.items()})


@pytest.mark.parametrize(
    "drop,softplus",
    [
        (("D", "z", "delta_bias"), True),  # bare scan
        (("z",), True),  # skip D, no gate
        (("D",), True),  # gate, no skip
        (("delta_bias",), False),  # step sizes used as given
        ((), False),  # bias added, no softplus
    ],
    ids=["bare", "no_z", "no_D", "no_softplus_no_bias", "bias_no_softplus"],
)
def test_optional_arguments(device, drop, softplus):
    inputs = _inputs(2, 20, 9, 4, torch.float64, device)
    if not softplus:
        inputs["delta"] = inputs["delta"].abs()  # positive step sizes, as softplus would give
        inputs["delta_bias"] = inputs["delta_bias"].abs()
    _check(inputs, tol=1e-10, softplus=softplus, drop=drop)


@pytest.mark.parametrize("d", [20, 32])
def test_grouped_B_C(device, d):
    """Groups of 10 channels (not a power of two: masked channel blocks) and of 16."""
    _check(_inputs(2, d, 9, 4, torch.float64, device, groups=2), tol=1e-10)


@pytest.mark.parametrize("chunk", [4, 8])
def test_state_carried_across_chunks(device, monkeypatch, chunk):
    """Short chunks cut l = 21 into 3 or 6 chunks (the last padded): states and dh cross many borders,
    forward stores every entering state and backward rebuilds each chunk from it."""
    monkeypatch.setattr(sst, "MAX_CHUNK", chunk)
    assert sst.time_chunk(21) == chunk and sst.states_shape(2, 3, 21, 4) == (2, 3, -(-21 // chunk) - 1, 4)
    _check(_inputs(2, 3, 21, 4, torch.float64, device), tol=1e-10)


def test_layout_does_not_depend_on_the_tuned_config(monkeypatch):
    """Chunk length comes from the shape alone, so forward's states line up whichever BLOCK_D the autotuner picks.
    Backward's channels per program (CPP) are tuned: the candidates it may pick leave at most 8,192 programs and
    are no wider than the group, every BLOCK_D divides every CPP, and the batch is in the tuning key."""
    assert sst.time_chunk(256) == 256 and sst.time_chunk(1024) == 256 and sst.time_chunk(9) == 16
    if sst._INTERPRETED:  # the interpreter would run every config: one
        assert len(sst.fwd_kernel.configs) == len(sst.bwd_kernel.configs) == 1
    monkeypatch.setattr(sst, "_INTERPRETED", False)  # the GPU's candidates, not the interpreter's one config
    assert sst.backward_cpps(64, 1, 768) == (8, 16, 64)  # 6,144 / 3,072 / 768 programs at the reference shape
    assert sst.backward_cpps(128, 1, 768) == (16, 64)  # CPP 8 would be 12,288 programs
    assert sst.backward_cpps(4096, 1, 768) == (64,)  # none fits: the widest alone
    assert sst.backward_cpps(2, 2, 10) == (8,) and sst.backward_cpps(2, 1, 32) == (8, 16)  # no wider than the group
    block_ds = {c.kwargs["BLOCK_D"] for c in sst.bwd_kernel.configs} | {bd for bd, _ in sst.BWD_CONFIGS}
    assert all(c % bd == 0 for bd in block_ds for c in sst.BWD_CPP)
    assert "batch" in sst.bwd_kernel.keys


def test_backward_configs_are_pruned_by_shape_and_chunk(monkeypatch):
    """Only the CPPs `backward_cpps` keeps are timed; every block config made for the chunk, whatever the dtype and
    flags: with their register budgets none spills as launched (kernel_compile, sm_90)."""
    import triton

    monkeypatch.setattr(sst, "_INTERPRETED", False)  # the GPU's candidates
    configs = sst._configs(sst.BWD_CONFIGS + sst.SHORT_BWD_CONFIGS, sst.BWD_CPP, sst.BWD_MAXNREG)
    shape = {"batch": 64, "g": 1, "d": 768, "u_ptr": torch.empty(0, dtype=torch.float32, device="meta")}

    def blocks(named_args, **flags):
        return {(c.kwargs["BLOCK_D"], c.num_warps) for c in sst._prune_backward(configs, named_args, **flags)}

    kept = {c.kwargs["CPP"] for c in sst._prune_backward(configs, shape, HAS_Z=False, CHUNK=256)}
    assert kept == set(sst.backward_cpps(64, 1, 768))
    assert {c.kwargs["CPP"] for c in sst._prune_backward(configs, {**shape, "batch": 4096}, HAS_Z=False, CHUNK=256)} == {64}
    assert len(sst._prune_backward(configs, shape, HAS_Z=True, CHUNK=256)) == len(sst.BWD_CONFIGS) * len(kept)
    # Chunks of <= 64 steps take the 1-2 warp configs, longer ones the wide ones; the forward too.
    block = {"HAS_D": True, "HAS_BIAS": True, "SOFTPLUS": True}  # the Mamba block's flags
    for flags in ({}, block, {**block, "HAS_Z": True}):
        assert blocks(shape, CHUNK=64, **flags) == set(sst.SHORT_BWD_CONFIGS)
        assert blocks(shape, CHUNK=256, **flags) == set(sst.BWD_CONFIGS)
    # The budgets ptxas is given (`.maxnreg`): the configs that spilled without one, and only those.
    budgets = {(c.kwargs["BLOCK_D"], c.num_warps): c.maxnreg for c in configs}
    assert budgets == {**{pair: None for pair in sst.BWD_CONFIGS + sst.SHORT_BWD_CONFIGS}, **sst.BWD_MAXNREG}
    forward = sst._configs(sst.FWD_CONFIGS + sst.SHORT_FWD_CONFIGS, (), sst.FWD_MAXNREG)
    assert {(c.kwargs["BLOCK_D"], c.num_warps): c.maxnreg for c in forward if c.maxnreg} == sst.FWD_MAXNREG == {(8, 16): 128}
    forward = [triton.Config({"BLOCK_D": bd}, num_warps=w) for bd, w in sst.FWD_CONFIGS + sst.SHORT_FWD_CONFIGS]
    assert {(c.kwargs["BLOCK_D"], c.num_warps) for c in sst._prune_forward(forward, {}, CHUNK=32)} == set(sst.SHORT_FWD_CONFIGS)
    assert {(c.kwargs["BLOCK_D"], c.num_warps) for c in sst._prune_forward(forward, {}, CHUNK=128)} == set(sst.FWD_CONFIGS)


# BLOCK_D 4 (re-admitted at 4 warps by the specialised build) by default; the narrower blocks with -m slow.
@pytest.mark.parametrize("block_d, cpp", [(4, 8), (4, 16), pytest.param(2, 8, marks=pytest.mark.slow),
                                          pytest.param(1, 8, marks=pytest.mark.slow)])
def test_every_tuned_block_gives_the_same_gradients(device, monkeypatch, block_d, cpp):
    """dB and dC are summed from per-program partial rows: CPP 8 (four programs per group of 32 channels) and CPP 16
    (two programs, in a buffer with CPP 8's four slots) both equal the fp64 reference. So do the short-chunk configs'
    BLOCK_D 2 and 1, forward and backward, over 16-step chunks (l = 40: three chunks, the last padded)."""
    import triton

    monkeypatch.setattr(sst.fwd_kernel, "configs", [triton.Config({"BLOCK_D": block_d}, num_warps=1)])
    monkeypatch.setattr(sst.bwd_kernel, "configs", [triton.Config({"BLOCK_D": block_d, "CPP": cpp}, num_warps=1)])
    monkeypatch.setattr(sst, "backward_cpps", lambda b, g, k: (8,))  # slots for CPP 8, whichever runs
    monkeypatch.setenv("TREAD_SCAN_CHUNK", "16")
    _check(_inputs(2, 32, 40, 4, torch.float64, device), tol=1e-10)
    assert sst.bwd_kernel.best_config.kwargs == {"BLOCK_D": block_d, "CPP": cpp}


def test_a_chunk_length_outside_the_kernels_is_refused(monkeypatch):
    from routing import ConfigError

    monkeypatch.setenv("TREAD_SCAN_CHUNK", "100")
    with pytest.raises(ConfigError, match=r"TREAD_SCAN_CHUNK='100' is not a chunk length .* 16, 32, 64, 128, 256"):
        sst.time_chunk(256)
    monkeypatch.setenv("TREAD_SCAN_CHUNK", "64")
    assert sst.time_chunk(256) == 64 and sst.time_chunk(40) == 64 and sst.states_shape(2, 3, 256, 4) == (2, 3, 3, 4)


def test_bfloat16_inputs(device):
    """bf16 activations (fp32 A, D, delta_bias as mamba-ssm takes them): the kernel computes in fp32 from
    the bf16 values, so output and gradients are the fp64 result up to bf16 rounding: 1/128 of the largest."""
    inputs = _inputs(2, 6, 24, 8, torch.float32, device)
    for name in ("u", "delta", "B", "C", "z"):
        inputs[name] = inputs[name].bfloat16()
    _check(inputs, tol=1 / 128, ref_inputs={k: v.double() for k, v in inputs.items()})


def test_no_grad_forward_matches(device):
    """Without autograd the chunk states are not stored; the values must not change."""
    inputs = _inputs(2, 6, 40, 4, torch.float64, device)
    with torch.no_grad():
        y = selective_scan_triton(**inputs, delta_softplus=True)
    assert y.grad_fn is None
    assert _rel(y, selective_scan_ref(**inputs, delta_softplus=True)) < 1e-10


def test_reads_nothing_past_the_end(device):
    """Each tensor is followed in memory by NaNs; a load past the last step (e.g. of delta_{t+1}) would show."""

    def nan_padded(t: torch.Tensor) -> torch.Tensor:
        storage = torch.full((t.numel() + 64,), float("nan"), dtype=t.dtype, device=t.device)
        return storage[: t.numel()].view_as(t).copy_(t)  # contiguous, NaNs right after the last element

    inputs = _inputs(2, 3, 9, 4, torch.float64, device)
    leaves = {k: nan_padded(v).requires_grad_() for k, v in inputs.items()}
    y, y_ref = (fn(**leaves, delta_softplus=True) for fn in (selective_scan_triton, selective_scan_ref))
    grads, grads_ref = (torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out)) for out in (y, y_ref))
    assert _rel(y, y_ref) < 1e-10
    for name, g, g_ref in zip(leaves, grads, grads_ref):
        assert _rel(g, g_ref) < 1e-10, name


def test_no_overflow_for_very_negative_decay(device):
    """delta A of -1e5 per step: a_t = 0, values and every gradient finite and equal to the definition's.

    On an H200 the old backward, which formed a_t h_{t-1} as h_t - x_t, got d delta wrong by 1.4e-3: the
    compiler fused x_t = delta u B into the subtraction as an FMA, leaving the product's rounding error,
    times |A| = 1e4."""
    inputs = _inputs(2, 3, 9, 4, torch.float32, device)
    inputs["A"] = torch.full_like(inputs["A"], -1e4)
    inputs["delta"] = torch.full_like(inputs["delta"], 10.0)
    y, grads = _value_and_grads(selective_scan_triton, inputs)
    y_ref, grads_ref = _value_and_grads(selective_scan_ref, {k: v.double() for k, v in inputs.items()})
    assert torch.isfinite(y).all() and all(torch.isfinite(g).all() for g in grads.values())
    assert _rel(y, y_ref) < 1e-5
    for name in NAMES:
        assert _rel(grads[name], grads_ref[name]) < 1e-5, name


def test_decay_gradient_without_cancellation(device):
    """delta A from -20 to -30 (a_t ~ 1e-9 to 1e-13), fp32: the gradient of A is sum delta dh_t a_t h_{t-1},
    with a_t h_{t-1} far below the rounding of h_t. Formed as h_t - x_t it is all rounding error (or zero),
    which fails this check on the interpreter as on a GPU; the kernel's scan carries a_t h_{t-1} itself."""
    inputs = _inputs(2, 3, 9, 4, torch.float32, device)
    inputs["A"] = torch.full_like(inputs["A"], -1e4)
    g = torch.Generator().manual_seed(1)
    inputs["delta"] = (2e-3 * (1 + 0.5 * torch.rand(inputs["delta"].shape, generator=g))).to(device)
    y, grads = _value_and_grads(selective_scan_triton, inputs, softplus=False, drop=("delta_bias",))
    ref_inputs = {k: v.double() for k, v in inputs.items()}
    y_ref, grads_ref = _value_and_grads(selective_scan_ref, ref_inputs, softplus=False, drop=("delta_bias",))
    assert grads_ref["A"].abs().max() > 0  # the reference sees the tiny decays
    assert _rel(y, y_ref) < 1e-5
    for name, grad in grads.items():
        assert _rel(grad, grads_ref[name]) < 1e-5, name


def test_rejects_mismatched_B_C(device):
    inputs = _inputs(1, 4, 5, 2, torch.float32, device)
    with pytest.raises(ValueError, match="B and C"):
        selective_scan_triton(inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"][:, None])


def test_dispatcher_forces_triton_and_logs_it(device, caplog):
    inputs = _inputs(2, 3, 9, 4, torch.float32, device)
    cuda_kernels._announce.cache_clear()
    with caplog.at_level(logging.INFO, logger=cuda_kernels.__name__):
        forced = cuda_kernels.scan_fn(**inputs, delta_softplus=True, backend="triton")
    assert torch.equal(forced, selective_scan_triton(**inputs, delta_softplus=True))
    assert "selective scan: Triton kernel" in [r.getMessage() for r in caplog.records]
    with pytest.raises(ValueError, match="backend"):
        cuda_kernels.scan_fn(**inputs, backend="gluon")


def test_dispatcher_default_backend_from_environment(device, monkeypatch):
    """TREAD_SCAN_BACKEND picks the path when the caller (the Mamba block) names none."""
    inputs = _inputs(2, 3, 9, 4, torch.float32, device)
    called = []
    monkeypatch.setattr(cuda_kernels, "triton_selective_scan", lambda: lambda *args: called.append(args) or args[0])
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "triton")
    cuda_kernels.scan_fn(**inputs)
    assert len(called) == 1
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "torch")
    cuda_kernels.scan_fn(**inputs)
    assert len(called) == 1


def test_mamba_mixer_on_the_triton_path(device, monkeypatch):
    """The bidirectional mixer end to end: output and every parameter gradient agree with the PyTorch scan."""
    from backbones.mamba import BiMambaMixer

    torch.manual_seed(0)
    mixer = BiMambaMixer(d_model=8, d_state=4).to(device)
    tokens = torch.randn(2, 12, 8, device=device)  # (B, L, D)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TREAD_SCAN_BACKEND", backend)
        mixer.zero_grad()
        out = mixer(tokens)
        out.square().sum().backward()
        results[backend] = (out.detach(), {k: p.grad.clone() for k, p in mixer.named_parameters()})
    (out_torch, grads_torch), (out_triton, grads_triton) = results["torch"], results["triton"]
    assert _rel(out_triton, out_torch) < 1e-5
    for name, grad in grads_triton.items():
        assert _rel(grad, grads_torch[name]) < 1e-4, name


def test_launches_after_the_first_skip_the_autotuner(device, monkeypatch):
    """After the first call per shape and flags, the kernels are launched with the config each picked, without
    their autotuners (backbones/ops/triton_launch.py); the second call's values and gradients equal the first's."""
    inputs = _inputs(2, 3, 9, 4, torch.float64, device, seed=5)
    y, grads = _value_and_grads(selective_scan_triton, inputs)

    def refuse(*args, **kwargs):
        raise AssertionError("the autotuner ran again")

    monkeypatch.setattr(sst.fwd_kernel, "run", refuse)
    monkeypatch.setattr(sst.bwd_kernel, "run", refuse)
    y2, grads2 = _value_and_grads(selective_scan_triton, inputs)
    torch.testing.assert_close(y2, y, atol=0, rtol=0)
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], atol=0, rtol=0)
