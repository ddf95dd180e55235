"""The one-launch Bi-WKV kernels (TREAD_WKV_KERNEL=fused, backbones/ops/wkv_triton_fused.py) against the float64
O(T^2) definition and the 3-launch kernels.

Under Triton's interpreter (no GPU) a segment is 2 chunks (32 tokens), so T = 33 already walks two segments (the
second with a partial chunk and a chunk of padding) with running carries in both directions; the interpreter runs a
program's numpy ops one by one, so shapes stay small and T = 300 (10 segments), two channel blocks across
segments, keys of +-80, one token, the extreme decays and the state exchange between the two kernels are
`-m slow` (the default suite keeps the two-segment hand-off, a partial channel block, u beyond exp's range, bf16). Tolerances as in
tests/test_wkv_triton.py: y relative to the weighted average of |v| <= 1e-5, gradients relative to their largest
float64 entry <= 1e-5 (dw 3e-5), plus 1e-6 absolute for gradients that are exactly zero.
"""

from __future__ import annotations

import pytest
import torch

from backbones.ops import wkv_triton_fused
from backbones.ops.op_inputs import OpInputError
from backbones.ops.selective_scan_env import check_scan_environment
from backbones.ops.wkv_env import wkv_kernel
from routing import ConfigError
from test_wkv_triton import _check_against_float64, _check_bf16, _inputs, _value_and_grads


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv("TREAD_WKV_KERNEL", "fused")


@pytest.mark.parametrize(
    "B, T, C",
    [
        pytest.param(1, 1, 4, marks=pytest.mark.slow),  # one token: y = v exactly, dk = du = 0
        (1, 17, 20),  # one segment, its second chunk one token; one partial channel block
        (1, 33, 4),  # two segments both ways, the second with a one-token chunk and a chunk of padding
        # and two channel blocks, the second partial (C not a multiple of 16)
        pytest.param(1, 33, 40, marks=pytest.mark.slow),
    ],
)
def test_matches_float64_definition_and_chunked_kernels(B, T, C, device, fused, monkeypatch):
    inputs, grad_y = _inputs(B, T, C, decay_T=8.0, key_max=20.0)
    y, grads = _check_against_float64(inputs, grad_y, device)
    monkeypatch.setenv("TREAD_WKV_KERNEL", "chunked")
    y3, g3 = _value_and_grads(inputs, grad_y, "triton", device)
    torch.testing.assert_close(y, y3, atol=1e-6, rtol=1e-5)
    for name, a, b in zip("wukv", grads, g3):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item() + 1e-6, name


@pytest.mark.slow
def test_long_sequence_many_segments(device, fused):
    _check_against_float64(*_inputs(2, 300, 36, decay_T=8.0, key_max=20.0, seed=4), device)


# Both cases -m slow (about 8 s of CPU each under the interpreter): the default suite keeps the two-segment hand-off
# at ordinary decays above and u beyond exp's range below.
@pytest.mark.slow
@pytest.mark.parametrize("decay_T, key_max", [(400.0, 20.0), (40.0, 80.0)])
def test_extreme_decays_and_keys_across_segments(decay_T, key_max, device, fused, monkeypatch):
    """|w| = 10 per token both ways (carries moved by e^{+-320} per segment), or keys up to +-80 (e^80 is near fp32's
    limit): the scan's moves equal the 3-launch kernels' chunk-by-chunk walk. At keys +-80 both kernels' dw is 7e-5
    from float64 on these inputs (the chunked op's 1e-5: a sum with cancellation), so float64 decides the first."""
    inputs, grad_y = _inputs(1, 40, 4, decay_T=decay_T, key_max=key_max, seed=1)
    if key_max < 80:
        y, grads = _check_against_float64(inputs, grad_y, device)
    else:
        y, grads = _value_and_grads(inputs, grad_y, "triton", device)
    monkeypatch.setenv("TREAD_WKV_KERNEL", "chunked")
    y3, g3 = _value_and_grads(inputs, grad_y, "triton", device)
    torch.testing.assert_close(y, y3, atol=1e-6, rtol=1e-5)
    for name, a, b in zip("wukv", grads, g3):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item() + 1e-6, name


# The interpreter computes the padding rows' masked-out e^u too (numpy warns; a GPU does not).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp", "ignore:invalid value encountered in multiply")
def test_bonus_beyond_exp_range_across_segments(device, fused):
    """u = 100 (e^u overflows fp32 at 88.7) at 40 tokens: two segments, the last chunk padded. y and every gradient
    finite and equal to the fp64 definition's, as for the 3-launch kernels (tests/test_op_inputs.py)."""
    inputs, grad_y = _inputs(1, 40, 3, decay_T=8.0, key_max=5.0, seed=6)
    inputs[1].fill_(100.0)
    y, grads = _check_against_float64(inputs, grad_y, device)
    assert torch.isfinite(y).all() and all(torch.isfinite(g).all() for g in grads)


def test_bf16_in_bf16_out(device, fused):
    _check_bf16(1, 20, device)  # two chunks, the second partial


@pytest.mark.slow  # about 8 s of CPU under the interpreter: two forwards and two backwards
def test_either_backward_takes_either_forward_state(device, monkeypatch):
    """The fused forward saves the 3-launch forward's chunk carries (6, B, n, C), so the switch changes no state."""
    from backbones.ops import wkv_triton, wkv_triton_fused

    inputs, grad_y = _inputs(1, 33, 4, decay_T=8.0, key_max=20.0, seed=5)
    w, u, k, v = (t.to(device) for t in inputs)
    grad_y = grad_y.to(device)
    monkeypatch.setenv("TREAD_WKV_KERNEL", "chunked")
    y3, state3 = wkv_triton.forward(w, u, k, v)
    y1, state1 = wkv_triton_fused.forward(w, u, k, v, wkv_triton.chunk_len(33))
    torch.testing.assert_close(y1, y3, atol=1e-6, rtol=1e-5)
    # Scales are integers (equal or, at a rounding tie, one apart with the mantissas rescaled): compare values.
    for side in (0, 3):
        for field in (1, 2):
            a = state1[side + field] * torch.exp(state1[side])
            b = state3[side + field] * torch.exp(state3[side])
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    grads3 = wkv_triton.backward(w, u, k, v, state1, grad_y)  # the 3-launch backward from the fused state
    grads1 = wkv_triton_fused.backward(w, u, k, v, state3, grad_y, wkv_triton.chunk_len(33))
    for a, b in zip(grads1, grads3):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_switch_is_checked_in_one_sentence(monkeypatch):
    monkeypatch.delenv("TREAD_WKV_KERNEL", raising=False)
    assert wkv_kernel() == "chunked"
    monkeypatch.setenv("TREAD_WKV_KERNEL", "Fused")
    with pytest.raises(ConfigError, match=r"^TREAD_WKV_KERNEL='Fused' is not a Bi-WKV kernel \(names are lower case: "
                                          r"fused\); use chunked or fused"):
        check_scan_environment(cuda=True)
    monkeypatch.setenv("TREAD_WKV_KERNEL", "fused")
    assert check_scan_environment(cuda=True) == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert check_scan_environment(cuda=False) == [
        "note: TREAD_WKV_KERNEL=fused does nothing here: it picks the Triton Bi-WKV kernels, and without a CUDA GPU "
        "Bi-WKV runs the PyTorch op."]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [256, 4096])
def test_cuda_fused_matches_chunked_kernels(T, monkeypatch):
    inputs, grad_y = _inputs(4, T, 96, decay_T=8.0, key_max=20.0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        cast = [t.to(dtype) if t.dim() == 3 else t for t in inputs]
        monkeypatch.setenv("TREAD_WKV_KERNEL", "chunked")
        y3, g3 = _value_and_grads(cast, grad_y.to(dtype), "triton", "cuda")
        monkeypatch.setenv("TREAD_WKV_KERNEL", "fused")
        y1, g1 = _value_and_grads(cast, grad_y.to(dtype), "triton", "cuda")
        torch.testing.assert_close(y1.float(), y3.float(), atol=tol, rtol=tol)
        for name, a, b in zip("wukv", g1, g3):
            assert (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item(), name


def test_sequences_past_int32_offsets_are_refused_in_one_sentence(monkeypatch):
    # T C = 2^31 elements per sequence: the tiles' int32 offsets would wrap. Expanded views cost no memory, and the
    # refusal comes before anything is allocated or launched, in both passes.
    from backbones.ops import wkv_triton

    monkeypatch.setenv("TREAD_WKV_KERNEL", "fused")
    T, C = 2**21, 1024
    k = torch.zeros(1, 1, 1).expand(1, T, C)
    w, u = torch.zeros(C), torch.zeros(C)
    sentence = (r"^Bi-WKV's one-launch kernels address a sequence with int32 offsets, and T C = 2,147,483,648 reaches "
                r"2\^31; set TREAD_WKV_KERNEL=chunked for this shape\.$")
    with pytest.raises(OpInputError, match=sentence):
        wkv_triton.forward(w, u, k, k)
    with pytest.raises(OpInputError, match=sentence):
        wkv_triton.backward(w, u, k, k, torch.zeros(0), k)
    wkv_triton_fused._check_int32(T, C - 1)  # one element fewer per sequence passes the check
