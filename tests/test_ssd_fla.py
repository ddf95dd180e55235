"""Mamba-2's SSD on flash-linear-attention's chunk_simple_gla (backbones/ops/ssd_fla.py).

On the CPU: the mapping of SSD's tensors to chunk_simple_gla's arguments, with a torch recurrence of simple GLA
(S_t = exp(g_t) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t) standing in for the kernel, against our SSD's
definition, forward and gradients; and the dispatch. On a GPU (-m gpu): fla's kernel against our PyTorch SSD."""

from __future__ import annotations

import pytest
import torch

from backbones.mamba import BiMambaMixer
from backbones.ops import ssd_fla as sf
from backbones.ops.ssd import ssd_scan, ssd_scan_ref


def simple_gla_recurrence(q, k, v, g, scale):
    """Simple GLA one step at a time in chunk_simple_gla's layout: q, k (b, t, h, K), v (b, t, h, V), g (b, t, h)."""
    b, _, h, K = q.shape
    S = q.new_zeros(b, h, K, v.shape[-1])
    outs = []
    for q_t, k_t, v_t, g_t in zip(q.unbind(1), k.unbind(1), v.unbind(1), g.unbind(1)):
        S = torch.exp(g_t.to(S.dtype))[..., None, None] * S + k_t[..., :, None] * v_t[..., None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q_t, S))
    return torch.stack(outs, 1), None  # t x (b, h, V) -> (b, t, h, V)


def _inputs(b=2, length=19, h=4, p=3, g=2, n=5, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    t = dict(x=torch.randn(b, length, h, p, generator=gen), dt=torch.rand(b, length, h, generator=gen) * 0.5 + 0.01,
             A=-torch.rand(h, generator=gen) * 8 - 1, B=torch.randn(b, length, g, n, generator=gen),
             C=torch.randn(b, length, g, n, generator=gen), D=torch.randn(h, generator=gen))
    return {k: v.to(device=device, dtype=dtype).requires_grad_() for k, v in t.items()}


@pytest.mark.parametrize("with_D", [True, False])
def test_gla_mapping_matches_ssd_definition(with_D):
    inputs = _inputs()
    if not with_D:
        inputs["D"] = None
    got = sf.ssd_fla(**inputs, kernel=simple_gla_recurrence)
    want = ssd_scan_ref(**inputs)
    torch.testing.assert_close(got, want)
    dy = torch.randn_like(want)
    leaves = [v for v in inputs.values() if v is not None]
    for name, a, b in zip(inputs, torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


def test_gla_arguments_layout():
    inputs = _inputs(h=4, g=2)
    args = sf.gla_arguments(*(inputs[k] for k in ("x", "dt", "A", "B", "C")))
    assert args["q"].shape == args["k"].shape == (2, 19, 4, 5)  # [B, T, H, K]: heads 0, 1 read group 0
    torch.testing.assert_close(args["q"][:, :, 1], inputs["C"][:, :, 0])
    torch.testing.assert_close(args["k"][:, :, 2], inputs["B"][:, :, 1])
    assert args["v"].shape == (2, 19, 4, 3) and args["g"].shape == (2, 19, 4) and args["scale"] == 1.0
    assert (args["g"] <= 0).all()  # a log decay


def test_cpu_dispatch_runs_our_ssd(monkeypatch):
    inputs = _inputs(dtype=torch.float32)
    assert sf.ssd_backend(on_cuda=False) == "torch"
    torch.testing.assert_close(sf.ssd_fn(**inputs), ssd_scan(**inputs))
    monkeypatch.setenv("TREAD_SSD_BACKEND", "fla")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        sf.ssd_fn(**inputs)
    monkeypatch.setenv("TREAD_SSD_BACKEND", "mamba")
    with pytest.raises(ValueError, match="TREAD_SSD_BACKEND must be one of"):
        sf.ssd_backend(on_cuda=True)


def test_refuses_heads_not_divisible_by_groups():
    inputs = _inputs(h=3, g=2)
    with pytest.raises(ValueError, match="not divisible"):
        sf.ssd_fla(**inputs, kernel=simple_gla_recurrence)


needs_fla = pytest.mark.skipif(not torch.cuda.is_available() or sf.fla_chunk_simple_gla() is None,
                               reason="needs CUDA and flash-linear-attention (pip install -e '.[cuda]')")


@pytest.mark.gpu
@needs_fla
# fla's fp32 matmuls may run in TF32 (10-bit mantissa), hence 5e-3 in fp32.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("length", [1, 17, 300])
def test_fla_kernel_matches_our_ssd(dtype, tol, length):
    inputs = _inputs(b=2, length=length, h=8, p=64, g=1, n=16, dtype=torch.float32, device="cuda")
    inputs["x"] = inputs["x"].detach().to(dtype).requires_grad_()
    got = sf.ssd_fla(**inputs)
    want = ssd_scan(**inputs)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    dy = torch.randn_like(want)
    leaves = list(inputs.values())
    for name, a, b in zip(inputs, torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        scale = b.float().abs().max().clamp(min=1)
        torch.testing.assert_close(a.float() / scale, b.float() / scale, atol=tol, rtol=tol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.gpu
@needs_fla
def test_bidirectional_mamba2_mixer_on_fla(monkeypatch):
    torch.manual_seed(0)
    mixer = BiMambaMixer(128, ssm="mamba2", headdim=32).cuda()
    tokens = torch.randn(2, 64, 128, device="cuda", requires_grad=True)
    out = mixer(tokens)
    monkeypatch.setenv("TREAD_SSD_BACKEND", "torch")
    want = mixer(tokens)
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)  # TF32 inside fla
    g_out, g_want = (torch.autograd.grad(o.square().sum(), tokens) for o in (out, want))
    scale = g_want[0].abs().max()
    torch.testing.assert_close(g_out[0] / scale, g_want[0] / scale, atol=1e-2, rtol=1e-2)
