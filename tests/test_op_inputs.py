"""The ops' public entry points refuse bad arguments in one sentence, and run at odd shapes.

Selective scan (backbones/ops/selective_scan.py, selective_scan_triton.py) and Bi-WKV (backbones/ops/wkv.py), on
the PyTorch path and the Triton kernels (under the interpreter here, tests/conftest.py). A refusal is an
OpInputError, a ConfigError, so every command prints it as one line and exits 2; the checks read shapes, dtypes
and devices only, so each runs before any work. The odd shapes: L = 1, 17, 300 (one step, a partial chunk, and
more than one 256-step scan chunk or 16-token WKV chunk) at channel counts that are not multiples of 16.
"""

from __future__ import annotations

import pytest
import torch

from backbones.ops.op_inputs import OpInputError
from backbones.ops.selective_scan import selective_scan, selective_scan_ref
from backbones.ops.selective_scan_triton import selective_scan_triton
from backbones.ops.wkv import bi_wkv, bi_wkv_reference
from routing import ConfigError
from train.cli import friendly_errors


def _scan_inputs(b=2, d=3, length=5, n=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        u=torch.randn(b, d, length, generator=g, dtype=dtype),
        delta=torch.randn(b, d, length, generator=g, dtype=dtype) * 0.5,
        A=-(torch.rand(d, n, generator=g, dtype=dtype) * 2 + 0.1),
        B=torch.randn(b, n, length, generator=g, dtype=dtype),
        C=torch.randn(b, n, length, generator=g, dtype=dtype),
        D=torch.randn(d, generator=g, dtype=dtype),
        z=torch.randn(b, d, length, generator=g, dtype=dtype),
        delta_bias=torch.randn(d, generator=g, dtype=dtype) * 0.3,
    )


# (what is wrong, how to make it so, the words the sentence must contain)
_SCAN_FAULTS = [
    ("2-D u", lambda x: x.update(u=x["u"][0]), r"u must be \(batch, channels, length\), got shape \(3, 5\)"),
    ("delta too short", lambda x: x.update(delta=x["delta"][..., :4]), r"delta has shape \(2, 3, 4\), expected"),
    ("z of another batch", lambda x: x.update(z=x["z"][:1]), r"z has shape \(1, 3, 5\)"),
    ("A of other channels", lambda x: x.update(A=x["A"][:2]), r"A has shape \(2, 4\), expected \(channels, states\)"),
    ("B too short", lambda x: x.update(B=x["B"][..., :4], C=x["C"][..., :4]), r"B has shape \(2, 4, 4\)"),
    ("B, C of two shapes", lambda x: x.update(C=x["C"][:, None]), r"B and C must both be"),
    ("D of other channels", lambda x: x.update(D=x["D"][:2]), r"D has shape \(2,\), expected \(channels,\)"),
    ("delta_bias 2-D", lambda x: x.update(delta_bias=x["delta_bias"][None]), r"delta_bias has shape \(1, 3\)"),
    ("integer delta", lambda x: x.update(delta=x["delta"].long()), r"delta has dtype torch.int64"),
    ("D on another device", lambda x: x.update(D=x["D"].to("meta")), r"D is on meta but the input is on cpu"),
    ("no steps", lambda x: x.update(**{k: x[k][..., :0] for k in ("u", "delta", "z", "B", "C")}), r"u has length 0"),
]


@pytest.mark.parametrize("fault, make, words", _SCAN_FAULTS, ids=[f[0] for f in _SCAN_FAULTS])
@pytest.mark.parametrize("scan", [selective_scan, selective_scan_triton, selective_scan_ref],
                         ids=["torch", "triton", "reference"])
def test_scan_refuses_bad_arguments_in_one_sentence(scan, fault, make, words):
    inputs = _scan_inputs()
    make(inputs)
    with pytest.raises(OpInputError, match=words) as err:
        scan(**inputs, delta_softplus=True)
    assert str(err.value).startswith("selective scan: ") and "\n" not in str(err.value)


def _wkv_inputs(B=2, T=5, C=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(w=torch.rand(C, generator=g) * 0.2, u=torch.randn(C, generator=g) * 0.2,
                k=torch.randn(B, T, C, generator=g), v=torch.randn(B, T, C, generator=g))


_WKV_FAULTS = [
    ("2-D k", lambda x: x.update(k=x["k"][0], v=x["v"][0]), r"k must be \(batch, tokens, channels\), got shape \(5, 3\)"),
    ("v of other tokens", lambda x: x.update(v=x["v"][:, :4]), r"v has shape \(2, 4, 3\), expected k's"),
    ("w of other channels", lambda x: x.update(w=x["w"][:2]), r"w has shape \(2,\), expected \(channels,\)"),
    ("u 2-D", lambda x: x.update(u=x["u"][None]), r"u has shape \(1, 3\)"),
    ("integer v", lambda x: x.update(v=x["v"].long()), r"v has dtype torch.int64"),
    ("k, v on another device", lambda x: x.update(k=x["k"].to("meta"), v=x["v"].to("meta")),
     r"w is on cpu but the input is on meta"),
    ("no tokens", lambda x: x.update(k=x["k"][:, :0], v=x["v"][:, :0]), r"k has 0 tokens"),
]


@pytest.mark.parametrize("fault, make, words", _WKV_FAULTS, ids=[f[0] for f in _WKV_FAULTS])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_wkv_refuses_bad_arguments_in_one_sentence(backend, fault, make, words):
    inputs = _wkv_inputs()
    make(inputs)
    with pytest.raises(OpInputError, match=words) as err:
        bi_wkv(**inputs, backend=backend)
    assert str(err.value).startswith("Bi-WKV: ") and "\n" not in str(err.value)


def test_a_command_prints_the_refusal_as_one_line(capsys):
    """OpInputError is a ConfigError (and a ValueError): train.cli.friendly_errors prints it and exits 2."""
    inputs = _wkv_inputs()
    inputs["v"] = inputs["v"][:, :4]
    with pytest.raises(SystemExit) as stop:
        friendly_errors(lambda: bi_wkv(**inputs))()
    assert stop.value.code == 2
    assert issubclass(OpInputError, ConfigError) and issubclass(OpInputError, ValueError)
    assert capsys.readouterr().err.splitlines() == [
        "error: Bi-WKV: v has shape (2, 4, 3), expected k's (batch, tokens, channels) = (2, 5, 3)."]


def _grads(fn, inputs: dict, **kwargs):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    y = fn(**leaves, **kwargs)
    gy = torch.cos(torch.arange(y.numel(), dtype=torch.float64)).view_as(y).to(y.dtype)
    return [y.detach(), *torch.autograd.grad(y, list(leaves.values()), gy)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("length", [1, 17, pytest.param(300, marks=pytest.mark.slow)])  # 300: ~1 min interpreted
def test_scan_at_odd_lengths_and_channels(length):
    """d = 20 channels (two channel blocks, the second partial), n = 4; the Triton kernels and the PyTorch scan
    against the sequential definition in fp64. At 300 steps the kernels cut two 256-step chunks."""
    inputs = _scan_inputs(b=1, d=20, length=length, n=4, dtype=torch.float64)
    expected = _grads(selective_scan_ref, inputs, delta_softplus=True)
    for scan in (selective_scan_triton, selective_scan):
        for name, got, ref in zip(["out", *inputs], _grads(scan, inputs, delta_softplus=True), expected):
            assert _rel(got, ref) < 1e-10, (scan.__name__, name)


@pytest.mark.parametrize("T", [1, 17, pytest.param(300, marks=pytest.mark.slow)])  # 300: ~1 min interpreted
def test_wkv_at_odd_lengths_and_channels(T):
    """C = 20 channels; the kernels (16-token chunks: 17 is one full and one 1-token chunk, 300 is 19 chunks) and the
    chunked op against the fp64 definition."""
    inputs = _wkv_inputs(B=1, T=T, C=20)
    expected = _grads(bi_wkv_reference, {k: v.double() for k, v in inputs.items()})
    for backend in ("triton", "torch"):
        for name, got, ref in zip(["y", *inputs], _grads(bi_wkv, inputs, backend=backend), expected):
            assert _rel(got, ref) < 3e-5 or (got - ref).abs().max() < 1e-6, (backend, name)


# The interpreter computes the padding rows' masked-out e^u too (numpy warns; a GPU does not).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp", "ignore:invalid value encountered in multiply")
@pytest.mark.parametrize("bonus", [100.0, pytest.param(-100.0, marks=pytest.mark.slow)])
def test_wkv_bonus_beyond_exp_range_is_exact(bonus):
    """e^u overflows fp32 at u = 88.7: both paths scale it out (a constant that cancels), so y and every gradient
    stay finite and equal the fp64 definition's, at 17 tokens (a padded last chunk, whose padding rows see e^u)."""
    inputs = _wkv_inputs(B=1, T=17, C=3)
    inputs["u"] = torch.full((3,), bonus)
    expected = _grads(bi_wkv_reference, {k: v.double() for k, v in inputs.items()})
    for backend in ("triton", "torch"):
        got = _grads(bi_wkv, inputs, backend=backend)
        for name, a, b in zip(["y", "w", "u", "k", "v"], got, expected):
            assert torch.isfinite(a).all(), (backend, name)
            assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max() + 1e-6, (backend, name)
