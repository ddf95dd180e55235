"""The Triton selective scan against the sequential definition: values and the gradients of every input.

On a machine without a GPU the kernels run under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1
before anything imports them). Triton ships with torch, so a failing import fails these tests.
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
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _plane_scan(self, inputs):
    """The interpreter's ScanOps.generic_scan, one hyperplane along the scanned axis at a time.

    Triton's interpreter applies a custom combine function element by element in Python (about 40 us
    each), which would make this file take minutes. This applies the same combine function in the same
    order to whole (..., 1, ...) slices; test_plane_scan_equals_the_interpreters checks it against the
    original.
    """
    planes = [np.moveaxis(t.handle.data, self.axis, 0) for t in inputs]
    outs = [np.empty_like(t.handle.data) for t in inputs]
    out_planes = [np.moveaxis(o, self.axis, 0) for o in outs]  # writable views, scanned axis first
    acc = None
    for i in range(planes[0].shape[0]):
        cur = tuple(self.to_tensor(np.ascontiguousarray(p[i]), t.dtype) for p, t in zip(planes, inputs))
        if acc is None:
            acc = cur
        else:
            ret = self.combine_fn.fn(*acc, *cur)
            acc = ret if isinstance(ret, tuple) else (ret,)
        for o, a in zip(out_planes, acc):
            o[i] = a.handle.data
    return [self.to_tensor(o, t.dtype) for o, t in zip(outs, inputs)]


if sst._INTERPRETED:
    from triton.runtime.interpreter import ScanOps as _ScanOps

    _ORIGINAL_GENERIC_SCAN = _ScanOps.generic_scan


@pytest.fixture(autouse=True)
def fast_interpreter_scan(monkeypatch):
    if sst._INTERPRETED:
        from triton.runtime.interpreter import ScanOps

        monkeypatch.setattr(ScanOps, "generic_scan", _plane_scan)


@pytest.mark.skipif(not sst._INTERPRETED, reason="on a GPU the compiled kernels run and nothing is patched")
def test_plane_scan_equals_the_interpreters():
    """The speed-up above must compute exactly what the interpreter computes (forward and reverse)."""
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import ScanOps

    @triton.jit
    def scan_kernel(a_ptr, x_ptr, out_ptr, REVERSE: tl.constexpr):
        idx = tl.arange(0, 2)[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        _, h = tl.associative_scan((tl.load(a_ptr + idx), tl.load(x_ptr + idx)), 2, sst._compose, reverse=REVERSE)
        tl.store(out_ptr + idx, h)

    g = torch.Generator().manual_seed(0)
    a, x = torch.rand(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    for reverse in (False, True):
        fast, slow = torch.empty_like(x), torch.empty_like(x)
        scan_kernel[(1,)](a, x, fast, reverse)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ScanOps, "generic_scan", _ORIGINAL_GENERIC_SCAN)  # element by element
            scan_kernel[(1,)](a, x, slow, reverse)
        assert torch.equal(fast, slow)
        # And both are the recurrence h_t = a_t h_{t-1} + x_t (h_{t+1} when reversed).
        h, expected = torch.zeros(2, 4), torch.empty_like(x)
        for t in range(7, -1, -1) if reverse else range(8):
            h = a[..., t] * h + x[..., t]
            expected[..., t] = h
        torch.testing.assert_close(fast, expected)


def _inputs(b, d, length, n, dtype, groups=None, seed=0):
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
    return {k: v.to(DEVICE, dtype) for k, v in tensors.items()}


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


@pytest.mark.parametrize("n", [4, 16])
@pytest.mark.parametrize("length", [1, 9, 40])
@pytest.mark.parametrize("d", [3, 20])
def test_float64_matches_definition(d, length, n):
    """The algebra, forward and backward, exactly: fp64 in, fp64 state, against the sequential loop."""
    _check(_inputs(2, d, length, n, torch.float64), tol=1e-10)


@pytest.mark.parametrize("d,length,n", [(3, 40, 4), (20, 40, 16)])
def test_float32_within_state_tolerance(d, length, n):
    """fp32 kernel vs the fp64 definition on the same values: 1e-5 of the largest magnitude."""
    inputs = _inputs(2, d, length, n, torch.float32)
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
def test_optional_arguments(drop, softplus):
    inputs = _inputs(2, 20, 9, 4, torch.float64)
    if not softplus:
        inputs["delta"] = inputs["delta"].abs()  # positive step sizes, as softplus would give
        inputs["delta_bias"] = inputs["delta_bias"].abs()
    _check(inputs, tol=1e-10, softplus=softplus, drop=drop)


@pytest.mark.parametrize("d", [20, 32])
def test_grouped_B_C(d):
    """Groups of 10 channels (not a power of two: masked channel blocks) and of 16."""
    _check(_inputs(2, d, 9, 4, torch.float64, groups=2), tol=1e-10)


@pytest.mark.parametrize("tile_elements", [32, 64])
def test_state_carried_across_chunks(monkeypatch, tile_elements):
    """Tiny tiles cut l = 40 into chunks of 2 or 4 steps (some padded): the state and dh cross many borders."""
    monkeypatch.setattr(sst, "_TILE_ELEMENTS", tile_elements)
    assert sst._blocks(3, 4, 40)[2] == tile_elements // 16
    _check(_inputs(2, 3, 41, 4, torch.float64), tol=1e-10)


def test_bfloat16_inputs():
    """bf16 activations (fp32 A, D, delta_bias as mamba-ssm takes them): the kernel computes in fp32 from
    the bf16 values, so output and gradients are the fp64 result up to bf16 rounding: 1/128 of the largest."""
    inputs = _inputs(2, 20, 40, 16, torch.float32)
    for name in ("u", "delta", "B", "C", "z"):
        inputs[name] = inputs[name].bfloat16()
    _check(inputs, tol=1 / 128, ref_inputs={k: v.double() for k, v in inputs.items()})


def test_no_grad_forward_matches():
    """Without autograd the chunk states are not stored; the values must not change."""
    inputs = _inputs(2, 20, 40, 4, torch.float64)
    with torch.no_grad():
        y = selective_scan_triton(**inputs, delta_softplus=True)
    assert y.grad_fn is None
    assert _rel(y, selective_scan_ref(**inputs, delta_softplus=True)) < 1e-10


def test_reads_nothing_past_the_end():
    """Each tensor is followed in memory by NaNs; a load past the last step (e.g. of delta_{t+1}) would show."""

    def nan_padded(t: torch.Tensor) -> torch.Tensor:
        storage = torch.full((t.numel() + 64,), float("nan"), dtype=t.dtype, device=t.device)
        return storage[: t.numel()].view_as(t).copy_(t)  # contiguous, NaNs right after the last element

    inputs = _inputs(2, 3, 9, 4, torch.float64)
    leaves = {k: nan_padded(v).requires_grad_() for k, v in inputs.items()}
    y, y_ref = (fn(**leaves, delta_softplus=True) for fn in (selective_scan_triton, selective_scan_ref))
    grads, grads_ref = (torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out)) for out in (y, y_ref))
    assert _rel(y, y_ref) < 1e-10
    for name, g, g_ref in zip(leaves, grads, grads_ref):
        assert _rel(g, g_ref) < 1e-10, name


def test_no_overflow_for_very_negative_decay():
    """delta A of -1e5 per step: a_t = 0, values and gradients finite and equal to the definition's."""
    inputs = _inputs(2, 3, 9, 4, torch.float32)
    inputs["A"] = torch.full_like(inputs["A"], -1e4)
    inputs["delta"] = torch.full_like(inputs["delta"], 10.0)
    y, grads = _value_and_grads(selective_scan_triton, inputs)
    y_ref, grads_ref = _value_and_grads(selective_scan_ref, {k: v.double() for k, v in inputs.items()})
    assert torch.isfinite(y).all() and all(torch.isfinite(g).all() for g in grads.values())
    assert _rel(y, y_ref) < 1e-5
    for name in ("u", "delta", "B", "C", "D", "z"):
        assert _rel(grads[name], grads_ref[name]) < 1e-5, name


def test_rejects_mismatched_B_C():
    inputs = _inputs(1, 4, 5, 2, torch.float32)
    with pytest.raises(ValueError, match="B and C"):
        selective_scan_triton(inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"][:, None])


def test_dispatcher_forces_triton_and_logs_it(caplog):
    inputs = _inputs(2, 3, 9, 4, torch.float32)
    cuda_kernels._announce.cache_clear()
    with caplog.at_level(logging.INFO, logger=cuda_kernels.__name__):
        forced = cuda_kernels.scan_fn(**inputs, delta_softplus=True, backend="triton")
    assert torch.equal(forced, selective_scan_triton(**inputs, delta_softplus=True))
    assert "selective scan: Triton kernel" in [r.getMessage() for r in caplog.records]
    with pytest.raises(ValueError, match="backend"):
        cuda_kernels.scan_fn(**inputs, backend="cuda")


def test_dispatcher_default_backend_from_environment(monkeypatch):
    """TREAD_SCAN_BACKEND picks the path when the caller (the Mamba block) names none."""
    inputs = _inputs(2, 3, 9, 4, torch.float32)
    called = []
    monkeypatch.setattr(cuda_kernels, "triton_selective_scan", lambda: lambda *args: called.append(args) or args[0])
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "triton")
    cuda_kernels.scan_fn(**inputs)
    assert len(called) == 1
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "torch")
    cuda_kernels.scan_fn(**inputs)
    assert len(called) == 1


def test_mamba_mixer_on_the_triton_path(monkeypatch):
    """The bidirectional mixer end to end: output and every parameter gradient agree with the PyTorch scan."""
    from backbones.mamba import BiMambaMixer

    torch.manual_seed(0)
    mixer = BiMambaMixer(d_model=8, d_state=4).to(DEVICE)
    tokens = torch.randn(2, 12, 8, device=DEVICE)  # (B, L, D)
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
