"""Bi-WKV: the chunked op against the float64 O(T^2) definition, its gradients, and its numerical safety."""

from __future__ import annotations

import pytest
import torch

from backbones.ops.wkv import bi_wkv, bi_wkv_reference


def _inputs(B: int, T: int, C: int, decay_T: float, key_max: float, seed: int = 0, dtype=torch.float32):
    """w, u (C,) divided by T as the caller does; keys uniform in [-key_max, key_max]; v ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(C, generator=g, dtype=dtype) * 2 - 1) * decay_T / T  # w T in [-decay_T, decay_T]
    u = torch.randn(C, generator=g, dtype=dtype) / T
    k = (torch.rand(B, T, C, generator=g, dtype=dtype) * 2 - 1) * key_max
    v = torch.randn(B, T, C, generator=g, dtype=dtype)
    return w, u, k, v


def _error(w, u, k, v, chunk_len: int = 32) -> float:
    """Largest error of fp32 bi_wkv against the float64 definition, per element relative to the weighted
    average of |v| (y is a weighted average of v; that is the scale its cancellation can reach)."""
    y = bi_wkv(w, u, k, v, chunk_len=chunk_len).double()
    w, u, k, v = (t.double() for t in (w, u, k, v))
    return ((y - bi_wkv_reference(w, u, k, v)).abs() / bi_wkv_reference(w, u, k, v.abs())).max().item()


@pytest.mark.parametrize("T", [1, 2, 7, 64, 256])
@pytest.mark.parametrize("decay_T", [8.0, 64.0, 200.0])  # Vision-RWKV inits w T in [-5, 3]
def test_matches_float64_definition(T, decay_T):
    assert _error(*_inputs(2, T, 16, decay_T, key_max=20.0)) <= 1e-5


@pytest.mark.parametrize("chunk_len", [1, 3, 32])
def test_chunking_and_padding_do_not_change_the_result(chunk_len):
    # T = 100 is no multiple of 3 or 32: padding, many carries (chunk_len 1, 3) and one long chunk.
    assert _error(*_inputs(2, 100, 8, 8.0, key_max=20.0), chunk_len=chunk_len) <= 1e-5


def test_positive_values_are_relatively_exact():
    # No cancellation with v > 0, so every output must be accurate relative to itself. Shifting keys by
    # one global max before a cumsum fails here (early prefix terms underflow once |w| T passes ~100).
    w, u, k, v = _inputs(2, 256, 16, 200.0, key_max=20.0)
    v = v.exp()
    y = bi_wkv(w, u, k, v).double()
    ref = bi_wkv_reference(*(t.double() for t in (w, u, k, v)))
    assert ((y - ref).abs() / ref).max().item() <= 1e-5


def test_quiet_chunk_next_to_loud_ones():
    # Keys 100 lower in the right half: its chunks receive carries ~e^100 above their own tokens, which
    # are stored capped at e^60 above them (see _CARRY_CAP); the result must not notice.
    w, u, k, v = _inputs(2, 64, 8, 8.0, key_max=1.0)
    k[:, 32:] -= 100.0
    k[:, 8:16] += 30.0
    assert _error(w, u, k, v, chunk_len=8) <= 1e-5


def test_very_fast_decays_shorten_the_chunks():
    # |w| = 10 per token: a 32-token chunk would span e^320; the op must cut chunks short and stay exact.
    assert _error(*_inputs(2, 32, 8, 320.0, key_max=5.0)) <= 1e-5


@pytest.mark.parametrize("chunk_len", [2, 32])
def test_gradcheck(chunk_len):
    w, u, k, v = (t.requires_grad_() for t in _inputs(2, 5, 3, 4.0, key_max=3.0, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda *a: bi_wkv(*a, chunk_len=chunk_len), (w, u, k, v))


def test_fp32_gradients_match_float64_definition():
    w, u, k, v = _inputs(2, 64, 8, 8.0, key_max=20.0)
    grad_y = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(1))
    fast = [t.clone().requires_grad_() for t in (w, u, k, v)]
    ref = [t.double().requires_grad_() for t in (w, u, k, v)]
    g_fast = torch.autograd.grad((bi_wkv(*fast) * grad_y).sum(), fast)
    g_ref = torch.autograd.grad((bi_wkv_reference(*ref) * grad_y.double()).sum(), ref)
    for name, a, b in zip("wukv", g_fast, g_ref):
        assert (a.double() - b).abs().max() <= 1e-4 * b.abs().max(), name


@pytest.mark.parametrize("key_max", [20.0, 80.0])
def test_long_sequence_with_large_keys_is_finite(key_max):
    w, u, k, v = (t.requires_grad_() for t in _inputs(1, 1024, 8, 8.0, key_max=key_max))
    y = bi_wkv(w, u, k, v)
    y.square().sum().backward()
    assert torch.isfinite(y).all()
    for t in (w, u, k, v):
        assert torch.isfinite(t.grad).all()


def test_bf16_in_bf16_out():
    w, u, k, v = _inputs(2, 64, 8, 8.0, key_max=5.0)
    y = bi_wkv(w.bfloat16(), u.bfloat16(), k.bfloat16(), v.bfloat16())
    assert y.dtype == torch.bfloat16
    # Only the inputs are rounded: the result must match fp32 on the same rounded inputs.
    y32 = bi_wkv(*(t.bfloat16().float() for t in (w, u, k, v)))
    torch.testing.assert_close(y.float(), y32, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    w, u, k, v = (t.requires_grad_() for t in _inputs(2, 256, 16, 8.0, key_max=20.0))
    y = bi_wkv(w, u, k, v)
    y.square().sum().backward()
    dev = [t.detach().cuda().requires_grad_() for t in (w, u, k, v)]
    y_cuda = bi_wkv(*dev)
    y_cuda.square().sum().backward()
    torch.testing.assert_close(y_cuda.cpu(), y, atol=1e-5, rtol=1e-5)
    # dw sums over every pair of tokens, so its entries are compared against its largest one.
    for name, a, b in zip("wukv", dev, (w, u, k, v)):
        assert (a.grad.cpu() - b.grad).abs().max() <= 1e-5 * b.grad.abs().max(), name


def test_runs_in_fp32_under_bf16_autocast():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 40, 8, generator=g), torch.randn(2, 40, 8, generator=g)
    w, u = torch.rand(8, generator=g) / 40, torch.rand(8, generator=g) / 40
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = bi_wkv(w, u, k, v)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, bi_wkv(w, u, k, v))
