"""Bi-WKV Triton kernels (backbones/ops/wkv_triton.py) against the float64 O(T^2) definition and the chunked op.

The kernels run where the tests run: on CUDA tensors when a GPU is present, and otherwise on CPU tensors through
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before they are imported), which is slow: shapes
stay small (one to three chunks of 16 tokens, one or two channel blocks of 32). Triton ships with torch, so a
missing triton is a failure here, never a skip.

Tolerances (fp32): y per element relative to the weighted average of |v| (the scale its cancellation can
reach, as in tests/test_wkv.py) <= 1e-5; dk, dv, du relative to their largest float64 entry <= 1e-5, dw
<= 3e-5 (a sum over B T^2 terms with cancellation; the chunked op shows the same ~1e-5 error on these
inputs), plus 1e-6 absolute for gradients that are exactly zero (T = 1: y = v, so dk = du = 0).
"""

from __future__ import annotations

import os

import pytest
import torch

from backbones.ops.wkv import bi_wkv, bi_wkv_reference


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run: the GPU when there is one (compiled kernels), else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(B: int, T: int, C: int, decay_T: float, key_max: float, seed: int = 0):
    """w, u (C,) divided by T as the caller does; keys uniform in [-key_max, key_max]; v, grad_y ~ N(0, 1).
    Built on the CPU (one generator for every device), moved by the caller."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(C, generator=g) * 2 - 1) * decay_T / T  # w T in [-decay_T, decay_T]
    u = torch.randn(C, generator=g) / T
    k = (torch.rand(B, T, C, generator=g) * 2 - 1) * key_max
    v = torch.randn(B, T, C, generator=g)
    grad_y = torch.randn(B, T, C, generator=g)
    return (w, u, k, v), grad_y


def _value_and_grads(inputs, grad_y, backend, device):
    """y and (dw, du, dk, dv) of bi_wkv on `device`, returned on the CPU."""
    leaves = [t.to(device).requires_grad_() for t in inputs]
    y = bi_wkv(*leaves, backend=backend)
    grads = torch.autograd.grad((y * grad_y.to(device, y.dtype)).sum(), leaves)
    return y.detach().cpu(), [g.cpu() for g in grads]


def _check_against_float64(inputs, grad_y, device):
    y, grads = _value_and_grads(inputs, grad_y, "triton", device)
    ref_in = [t.double().requires_grad_() for t in inputs]
    y_ref = bi_wkv_reference(*ref_in)
    g_ref = torch.autograd.grad((y_ref * grad_y.double()).sum(), ref_in)
    w, u, k, v = (t.double() for t in inputs)
    scale = bi_wkv_reference(w, u, k, v.abs())
    assert y.dtype == torch.float32
    assert ((y.double() - y_ref).abs() / scale).max().item() <= 1e-5
    for name, a, b in zip("wukv", grads, g_ref):
        tol = 3e-5 if name == "w" else 1e-5
        assert (a.double() - b).abs().max().item() <= tol * b.abs().max().item() + 1e-6, name
    return y, grads


def test_triton_imports():
    # A failure, not a skip: triton is a dependency of torch, and the CUDA path silently needs it.
    import triton  # noqa: F401

    from backbones.ops import wkv_triton  # noqa: F401


@pytest.mark.parametrize(
    "T, C",
    [
        (1, 4),  # one token: y = v exactly
        (7, 4),  # one partial chunk
        (33, 4),  # three chunks, the last with one token: carries cross two chunk boundaries and (under the
        # interpreter, two chunks per combine group) a group boundary in both directions
        (7, 48),  # two channel blocks, the second partial
    ],
)
def test_matches_float64_definition_and_chunked_op(T, C, device):
    inputs, grad_y = _inputs(2, T, C, decay_T=8.0, key_max=20.0)
    y, grads = _check_against_float64(inputs, grad_y, device)
    # The chunked op (the CPU path) on the same fp32 inputs: the two fp32 ops agree as closely.
    y_torch, g_torch = _value_and_grads(inputs, grad_y, "torch", "cpu")
    torch.testing.assert_close(y, y_torch, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("wukv", grads, g_torch):
        assert (a - b).abs().max().item() <= 3e-5 * b.abs().max().item() + 1e-6, name


@pytest.mark.parametrize(
    "T, decay_T, key_max",
    [
        (20, 200.0, 20.0),  # |w| T = 200 both ways: decays of e^{+-200} across the sequence
        (20, 200.0, 80.0),  # and keys up to +-80 (e^80 is near fp32's limit)
        (17, 170.0, 5.0),  # |w| = 10 per token: a neighbour two tokens away is already e^{+-10}
    ],
)
def test_extreme_decays_and_keys(T, decay_T, key_max, device):
    _check_against_float64(*_inputs(2, T, 8, decay_T=decay_T, key_max=key_max, seed=1), device)


def test_quiet_tokens_next_to_loud_ones(device):
    # Keys 100 lower in the second chunk: its outputs are all carry, its own tokens ~e^-100 below it.
    inputs, grad_y = _inputs(2, 24, 4, decay_T=8.0, key_max=1.0, seed=2)
    inputs[2][:, 16:] -= 100.0
    inputs[2][:, 4:8] += 30.0
    _check_against_float64(inputs, grad_y, device)


def test_bf16_in_bf16_out(device):
    _check_bf16(2, 7, device)


def _check_bf16(B: int, T: int, device):
    inputs, grad_y = _inputs(B, T, 8, decay_T=8.0, key_max=5.0)
    inputs = [t.bfloat16() for t in inputs]
    y, grads = _value_and_grads(inputs, grad_y.bfloat16(), "triton", device)
    assert y.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads[2:])
    # Only the inputs and outputs are rounded: the result must match fp32 on the same rounded inputs up
    # to bf16's output rounding (2^-8 relative; y is O(1), gradients relative to their largest entry).
    y32, g32 = _value_and_grads([t.float() for t in inputs], grad_y.bfloat16().float(), "torch", "cpu")
    torch.testing.assert_close(y.float(), y32, atol=1e-2, rtol=1e-2)
    for name, a, b in zip("wukv", grads, g32):
        assert (a.float() - b).abs().max().item() <= 1e-2 * b.abs().max().item(), name


def test_forward_without_grad_and_dispatch(device):
    inputs, _ = _inputs(2, 7, 4, decay_T=8.0, key_max=5.0)
    with torch.no_grad():
        y = bi_wkv(*(t.to(device) for t in inputs), backend="triton")
    torch.testing.assert_close(y.cpu(), bi_wkv(*inputs, backend="torch"), atol=1e-5, rtol=1e-5)
    # "auto" on CPU tensors is the chunked op, exactly.
    torch.testing.assert_close(bi_wkv(*inputs), bi_wkv(*inputs, backend="torch"), atol=0, rtol=0)
    with pytest.raises(ValueError, match="backend"):
        bi_wkv(*inputs, backend="cuda")
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        bi_wkv(*(t.double().to(device) for t in inputs), backend="triton")


def test_autotune_configs_keep_rows_in_thread():
    # The row picks are register moves only with threads along channels: BLOCK_C a multiple of 32 * num_warps.
    # Under the interpreter the list is one config (it would run them all); on a GPU several to choose from.
    from backbones.ops import wkv_triton

    configs = wkv_triton._configs()
    assert len(configs) == 1 if os.environ.get("TRITON_INTERPRET") == "1" else len(configs) > 1
    for cfg in configs:
        assert cfg.kwargs["BLOCK_C"] % (32 * cfg.num_warps) == 0


@pytest.mark.gpu
def test_cuda_dispatches_to_the_kernel_and_matches_cpu():
    inputs, grad_y = _inputs(4, 256, 96, decay_T=8.0, key_max=20.0)
    y_cpu, g_cpu = _value_and_grads(inputs, grad_y, "torch", "cpu")
    y, grads = _value_and_grads(inputs, grad_y, "auto", "cuda")
    torch.testing.assert_close(y, y_cpu, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("wukv", grads, g_cpu):
        assert (a - b).abs().max().item() <= 3e-5 * b.abs().max().item(), name


def test_eager_calls_skip_the_op_and_the_autotuner(device, monkeypatch):
    """The thin launch path: in eager mode bi_wkv calls the kernels' autograd.Function, never the custom op (the
    compiled path), and after the first call each autotuned kernel is launched with the config it picked, without
    its autotuner (backbones/ops/triton_launch.py). The second call's values and gradients equal the first's."""
    from backbones.ops import wkv_op, wkv_triton

    def refuse(*args, **kwargs):
        raise AssertionError("called on the hot path")

    monkeypatch.setattr(wkv_op, "bi_wkv_op", refuse)
    inputs, grad_y = _inputs(1, 5, 4, decay_T=2.0, key_max=1.0, seed=3)
    y, grads = _value_and_grads(inputs, grad_y, "triton", device)
    for kernel in (wkv_triton._fwd_sums_kernel, wkv_triton._fwd_kernel, wkv_triton._bwd_sums_kernel,
                   wkv_triton._bwd_kernel):
        monkeypatch.setattr(kernel, "run", refuse)  # kernel[grid](...) enters the autotuner through run
    y2, grads2 = _value_and_grads(inputs, grad_y, "triton", device)
    torch.testing.assert_close(y2, y, atol=0, rtol=0)
    for a, b in zip(grads2, grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
