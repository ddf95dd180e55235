"""Mamba ops on a GPU (run with -m gpu): our pure-PyTorch ops against the mamba-ssm / causal-conv1d CUDA
kernels (needs the `cuda` extra: pip install -e '.[cuda]'), our Triton scan against our PyTorch scan at a
Mamba-sized shape, and a block compiled with Inductor on CUDA against eager."""

from __future__ import annotations

import pytest
import torch

from backbones.ops.causal_conv import causal_conv1d
from backbones.ops.cuda_kernels import cuda_causal_conv1d, cuda_selective_scan, scan_fn
from backbones.ops.selective_scan import selective_scan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


# The kernels import only on a CUDA machine with the `cuda` extra; elsewhere these tests are reported skipped.
needs_mamba_ssm = pytest.mark.skipif(
    not torch.cuda.is_available() or cuda_selective_scan() is None, reason="mamba-ssm is not installed or does not import"
)
needs_causal_conv1d = pytest.mark.skipif(
    not torch.cuda.is_available() or cuda_causal_conv1d() is None, reason="causal-conv1d is not installed or does not import"
)


def _inputs(dtype: torch.dtype, b: int = 2, d: int = 64, n: int = 16, length: int = 256):
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=g)
    act = dict(
        u=torch.randn(b, d, length, **kw),
        delta=torch.randn(b, d, length, **kw) * 0.5 - 2,
        B=torch.randn(b, n, length, **kw),
        C=torch.randn(b, n, length, **kw),
        z=torch.randn(b, d, length, **kw),
    )
    params = dict(
        A=-torch.arange(1, n + 1.0, device="cuda").repeat(d, 1),
        D=torch.randn(d, **kw),
        delta_bias=torch.randn(d, **kw) * 0.1,
    )
    # mamba-ssm wants u, delta, B, C, z in the activation dtype and A, D, delta_bias in fp32.
    tensors = {k: v.to(dtype) for k, v in act.items()} | params
    return {k: v.requires_grad_() for k, v in tensors.items()}


@needs_mamba_ssm
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_scan_matches_mamba_ssm(dtype, tol):
    kernel = cuda_selective_scan()
    inputs = _inputs(dtype)
    names = list(inputs)
    y_ours = selective_scan(**inputs, delta_softplus=True)
    y_cuda = kernel(**inputs, delta_softplus=True)
    assert y_ours.dtype == y_cuda.dtype == dtype
    gy = torch.randn_like(y_ours)
    g_ours = torch.autograd.grad(y_ours, list(inputs.values()), gy)
    g_cuda = torch.autograd.grad(y_cuda, list(inputs.values()), gy)

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    assert rel(y_ours, y_cuda) < tol
    for name, a, b in zip(names, g_ours, g_cuda):
        assert rel(a, b) < tol, name


@needs_mamba_ssm
def test_dispatcher_uses_the_kernel_on_cuda():
    kernel = cuda_selective_scan()
    inputs = {k: v.detach() for k, v in _inputs(torch.float32).items()}
    torch.testing.assert_close(scan_fn(**inputs, delta_softplus=True), kernel(**inputs, delta_softplus=True))


@needs_causal_conv1d
@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv_matches_causal_conv1d(activation):
    kernel = cuda_causal_conv1d()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 64, 100, device="cuda", generator=g)
    weight, bias = torch.randn(64, 4, device="cuda", generator=g), torch.randn(64, device="cuda", generator=g)
    expected = kernel(x, weight, bias, activation=activation)
    torch.testing.assert_close(causal_conv1d(x, weight, bias, activation), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [256, 600])  # one chunk, and three (states stored and rebuilt)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_triton_scan_matches_ours_on_cuda(dtype, tol, length):
    """The compiled Triton kernels (autotuned on first use) against our PyTorch scan at a Mamba-sized shape."""
    from backbones.ops.selective_scan_triton import selective_scan_triton

    inputs = _inputs(dtype, length=length)
    y_triton = selective_scan_triton(**inputs, delta_softplus=True)
    y_ours = selective_scan(**inputs, delta_softplus=True)
    gy = torch.randn_like(y_ours)
    g_triton = torch.autograd.grad(y_triton, list(inputs.values()), gy)
    g_ours = torch.autograd.grad(y_ours, list(inputs.values()), gy)

    def rel(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    assert rel(y_triton, y_ours) < tol
    for name, a, b in zip(inputs, g_triton, g_ours):
        assert rel(a, b) < tol, name


def test_compiled_block_on_cuda_matches_eager(monkeypatch):
    """A Mamba block compiled with Inductor on CUDA (Triton scan as the custom op, fullgraph) trains like eager."""
    from backbones.mamba import Block

    monkeypatch.setenv("TREAD_SCAN_BACKEND", "triton")
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(2, 64, 32, generator=g).cuda(), torch.randn(2, 32, generator=g).cuda()
    losses = []
    for compile_it in (False, True):
        torch.manual_seed(0)
        block = Block(hidden_size=32, layer_idx=0, depth=1, d_state=16).cuda()
        with torch.no_grad():
            block.adaLN.proj[1].weight.normal_(0, 0.1)  # the zero-initialised modulation, randomised
        module = torch.compile(block, fullgraph=True) if compile_it else block
        opt = torch.optim.SGD(block.parameters(), lr=0.5)
        run = []
        for _ in range(3):
            loss = module(x, c, (8, 8)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.append(loss.item())
        losses.append(run)
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)
