"""The pure-PyTorch Mamba ops against their definitions: chunked selective scan vs the sequential loop
(values and every gradient), stability, the backward-in-time scan, SSD, and the causal conv."""

from __future__ import annotations

import logging

import pytest
import torch

from backbones.ops import cuda_kernels
from backbones.ops import selective_scan as ss
from backbones.ops.causal_conv import causal_conv1d
from backbones.ops.selective_scan import selective_scan, selective_scan_ref
from backbones.ops.ssd import ssd_scan, ssd_scan_ref

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def _inputs(length: int, dtype: torch.dtype, groups: int | None = None, b: int = 2, d: int = 4, n: int = 3):
    g = torch.Generator().manual_seed(length)
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
    return {k: v.to(dtype).requires_grad_() for k, v in tensors.items()}


def _run(fn, inputs: dict, softplus: bool):
    kwargs = dict(inputs)
    if not softplus:
        # Without softplus the step sizes are used as given; keep them positive as softplus would.
        kwargs["delta"] = kwargs["delta"].abs()
        kwargs["delta_bias"] = None
    y = fn(**kwargs, delta_softplus=softplus)
    leaves = [inputs[k] for k in NAMES if softplus or k != "delta_bias"]
    grads = torch.autograd.grad(y, leaves, torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y))
    return y, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# _STEP_ELEMENTS = 1 makes every slab "large": one chunk, streamed step by step. A huge value splits the
# sequence into the most chunks (sqrt(l)), the chunked form GPUs use.
PATHS = pytest.mark.parametrize("step_elements", [1, 1 << 30], ids=["streaming", "chunked"])


@PATHS
@pytest.mark.parametrize("length", [1, 3, 64, 256])
@pytest.mark.parametrize("softplus", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-8), (torch.float32, 1e-4)])
def test_scan_matches_sequential_reference(monkeypatch, step_elements, length, softplus, dtype, tol):
    monkeypatch.setattr(ss, "_STEP_ELEMENTS", step_elements)
    inputs = _inputs(length, dtype)
    y, grads = _run(selective_scan, inputs, softplus)
    y_ref, grads_ref = _run(selective_scan_ref, inputs, softplus)
    assert y.dtype == dtype
    assert _rel(y, y_ref) < tol
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        assert _rel(g, g_ref) < tol, name


@PATHS
def test_grouped_B_C_match_reference(monkeypatch, step_elements):
    monkeypatch.setattr(ss, "_STEP_ELEMENTS", step_elements)
    inputs = _inputs(40, torch.float64, groups=2)
    y, grads = _run(selective_scan, inputs, True)
    y_ref, grads_ref = _run(selective_scan_ref, inputs, True)
    assert _rel(y, y_ref) < 1e-10
    assert all(_rel(g, r) < 1e-10 for g, r in zip(grads, grads_ref))


@PATHS
def test_no_grad_forward_matches(monkeypatch, step_elements):
    """Without autograd the streaming path keeps only a running state; the values must not change."""
    monkeypatch.setattr(ss, "_STEP_ELEMENTS", step_elements)
    inputs = _inputs(50, torch.float64)
    with torch.no_grad():
        y = selective_scan(**inputs, delta_softplus=True)
    assert y.grad_fn is None
    assert _rel(y, selective_scan_ref(**inputs, delta_softplus=True)) < 1e-10


def test_half_precision_inputs_return_their_dtype():
    inputs = {k: v.detach().bfloat16() for k, v in _inputs(16, torch.float32).items()}
    y = selective_scan(**inputs, delta_softplus=True)
    y_ref = selective_scan_ref(**{k: v.float() for k, v in inputs.items()}, delta_softplus=True)
    assert y.dtype == torch.bfloat16
    assert _rel(y.float(), y_ref) < 1e-2


def test_no_overflow_for_very_negative_decay():
    """delta * A of -1e5 per step (and sums far below fp32's exp range) stay finite, values and gradients."""
    inputs = _inputs(256, torch.float32)
    with torch.no_grad():
        inputs["A"].fill_(-1e4)
        inputs["delta"].fill_(10.0)
    y, grads = _run(selective_scan, inputs, False)
    assert torch.isfinite(y).all()
    assert all(torch.isfinite(g).all() for g in grads)
    # With a decay of exp(-1e5) the state forgets at once: y_t = C_t (delta B_t u_t) + D u_t.
    u, delta, B, C, D = (inputs[k].detach() for k in ("u", "delta", "B", "C", "D"))
    expected = torch.einsum("bnl,bnl->bl", B, C)[:, None] * delta * u + D[:, None] * u
    expected = expected * torch.nn.functional.silu(inputs["z"].detach())
    torch.testing.assert_close(y.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_chunks", [1, 4])
def test_reverse_scan_equals_scanning_the_flipped_sequence(n_chunks):
    """The backward-in-time scan h_t = a_t h_{t+1} + x_t is the forward scan of the flipped sequence."""
    g = torch.Generator().manual_seed(0)
    a, x = torch.rand(32, 5, generator=g, dtype=torch.float64), torch.randn(32, 5, generator=g, dtype=torch.float64)
    decay = a.view(n_chunks, -1, 5).prod(1)  # (32, 5) -> (n_chunks, T, 5) -> (n_chunks, 5)
    h_rev = x.clone()
    ss._linear_scan(a, h_rev, decay, reverse=True)
    flipped_decay = a.flip(0).view(n_chunks, -1, 5).prod(1)  # (32, 5) -> (n_chunks, T, 5) -> (n_chunks, 5)
    h_flip = x.flip(0).clone()
    ss._linear_scan(a.flip(0).contiguous(), h_flip, flipped_decay, reverse=False)
    torch.testing.assert_close(h_rev, h_flip.flip(0), rtol=1e-12, atol=1e-12)
    # And the forward scan is the recurrence itself.
    h, state = [], torch.zeros(5, dtype=torch.float64)
    for a_t, x_t in zip(a.flip(0), x.flip(0)):
        state = a_t * state + x_t
        h.append(state)
    torch.testing.assert_close(h_flip, torch.stack(h), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("length,chunk", [(1, 64), (3, 2), (64, 16), (100, 32)])
def test_ssd_matches_sequential_reference(length, chunk):
    g = torch.Generator().manual_seed(length)
    b, h, p, groups, n = 2, 4, 3, 2, 5
    inputs = [
        torch.randn(b, length, h, p, generator=g),
        torch.rand(b, length, h, generator=g) * 0.5,
        -torch.rand(h, generator=g) * 3,
        torch.randn(b, length, groups, n, generator=g),
        torch.randn(b, length, groups, n, generator=g),
        torch.randn(h, generator=g),
    ]
    inputs = [t.double().requires_grad_() for t in inputs]
    y = ssd_scan(*inputs, chunk_size=chunk)
    y_ref = ssd_scan_ref(*inputs)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    assert _rel(y, y_ref) < 1e-10
    for grad, grad_ref in zip(torch.autograd.grad(y, inputs, gy), torch.autograd.grad(y_ref, inputs, gy)):
        assert _rel(grad, grad_ref) < 1e-10


def test_ssd_no_overflow_for_very_negative_decay():
    x = torch.randn(1, 200, 2, 3, requires_grad=True)
    dt = torch.full((1, 200, 2), 10.0)
    A = torch.tensor([-1e4, -1.0])
    y = ssd_scan(x, dt, A, torch.randn(1, 200, 1, 4), torch.randn(1, 200, 1, 4))
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv_matches_loop_definition(activation):
    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(2, 3, 10, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    expected = torch.zeros_like(x)
    for t in range(10):
        for i in range(4):
            src = t - 3 + i
            if src >= 0:
                expected[:, :, t] += weight[:, i] * x[:, :, src]
    expected += bias[:, None]
    if activation == "silu":
        expected = torch.nn.functional.silu(expected)
    torch.testing.assert_close(causal_conv1d(x, weight, bias, activation), expected)


def test_causal_conv_is_causal():
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(1, 2, 12, generator=g), torch.randn(2, 4, generator=g)
    changed = x.clone()
    changed[:, :, 7:] = torch.randn(1, 2, 5, generator=g)
    out, out_changed = causal_conv1d(x, weight), causal_conv1d(changed, weight)
    torch.testing.assert_close(out[:, :, :7], out_changed[:, :, :7])
    assert not torch.allclose(out[:, :, 7:], out_changed[:, :, 7:])


def test_dispatcher_on_cpu_uses_ours_and_logs_once(caplog):
    inputs = {k: v.detach() for k, v in _inputs(8, torch.float32).items()}
    cuda_kernels._announce.cache_clear()
    with caplog.at_level(logging.INFO, logger=cuda_kernels.__name__):
        first = cuda_kernels.scan_fn(**inputs, delta_softplus=True)
        cuda_kernels.scan_fn(**inputs, delta_softplus=True)
    assert torch.equal(first, selective_scan(**inputs, delta_softplus=True))
    assert [r.getMessage() for r in caplog.records] == ["selective scan: pure-PyTorch chunked scan"]
    x = inputs["u"]
    w = torch.randn(x.shape[1], 4)  # (d, k) depthwise kernel
    torch.testing.assert_close(cuda_kernels.conv_fn(x, w, activation="silu"), causal_conv1d(x, w, activation="silu"))
