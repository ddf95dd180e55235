"""The CUDA selective scan (backbones/ops/selective_scan_cuda.*).

On the CPU: its algorithm, written in torch (selective_scan_lanes.py), against the definition at odd shapes, forward
and every gradient; and (-m slow) its source compiled for sm_90 by nvcc with no error and no register spill.
On a GPU (-m gpu): the compiled kernels against the Triton and PyTorch scans, forward and every gradient."""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from backbones.ops import selective_scan_cuda as ssc
from backbones.ops.selective_scan import selective_scan, selective_scan_ref
from backbones.ops.selective_scan_lanes import lane_scan_backward, lane_scan_forward

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def _inputs(b=2, d=6, length=17, n=4, groups=None, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape_bc = (b, groups, n, length) if groups else (b, n, length)
    t = dict(
        u=torch.randn(b, d, length, generator=g),
        delta=torch.randn(b, d, length, generator=g) * 0.5 - 1,
        A=-torch.rand(d, n, generator=g) * 4 - 0.5,
        B=torch.randn(*shape_bc, generator=g),
        C=torch.randn(*shape_bc, generator=g),
        D=torch.randn(d, generator=g),
        z=torch.randn(b, d, length, generator=g),
        delta_bias=torch.randn(d, generator=g) * 0.3,
    )
    fp32 = ("A", "D", "delta_bias")
    return {k: v.to(device=device, dtype=torch.float32 if k in fp32 and dtype != torch.float64 else dtype)
            for k, v in t.items()}


def _definition(inputs, dout, softplus):
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items() if v is not None}
    out = selective_scan_ref(**leaves, delta_softplus=softplus)
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    return out, dict(zip(leaves, grads))


# (lanes, steps): the kernel's 32 x 8, and 4 x 2 so that 17 and 300 steps cross many chunks.
@pytest.mark.parametrize("lanes,steps", [(32, 8), (4, 2)])
@pytest.mark.parametrize("length", [1, 17, 300])
@pytest.mark.parametrize("groups", [None, 2])
def test_lane_algorithm_matches_definition(lanes, steps, length, groups):
    inputs = _inputs(length=length, groups=groups)
    dout = torch.randn(2, 6, length, dtype=torch.float64)
    want, want_grads = _definition(inputs, dout, softplus=True)
    out, states = lane_scan_forward(**inputs, delta_softplus=True, lanes=lanes, steps=steps)
    torch.testing.assert_close(out, want)
    assert states.shape == (2, 6, -(-length // (lanes * steps)) - 1, 4)
    grads = lane_scan_backward(dout, *inputs.values(), True, states, lanes=lanes, steps=steps)
    for name, got in zip(NAMES, grads):
        torch.testing.assert_close(got, want_grads[name], msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("drop", [("D", "z", "delta_bias"), ("z",), ("D",)])
def test_lane_algorithm_optional_arguments(drop):
    inputs = _inputs(length=40) | {k: None for k in drop}
    dout = torch.randn(2, 6, 40, dtype=torch.float64)
    want, want_grads = _definition(inputs, dout, softplus=False)
    out, states = lane_scan_forward(**inputs, lanes=4, steps=4)
    torch.testing.assert_close(out, want)
    grads = lane_scan_backward(dout, *inputs.values(), False, states, lanes=4, steps=4)
    for name, got in zip(NAMES, grads):
        assert (got is None) == (name in drop), name
        if got is not None:
            torch.testing.assert_close(got, want_grads[name], msg=lambda m, name=name: f"d{name}: {m}")


def test_lane_algorithm_decay_gradient_without_cancellation():
    """A decay of ~exp(-1e4 * 0.1) = 0: dh a h_{t-1} is exactly zero where h_t - x_t would leave rounding."""
    inputs = _inputs(length=33, dtype=torch.float32) | dict(D=None, z=None, delta_bias=None)
    inputs["A"] = torch.full((6, 4), -1e4)
    inputs["delta"] = torch.full((2, 6, 33), 0.1)
    dout = torch.randn(2, 6, 33)
    _, states = lane_scan_forward(**inputs, lanes=4, steps=2)
    grads = lane_scan_backward(dout, *inputs.values(), False, states, lanes=4, steps=2)
    want = _definition({k: v.double() if v is not None else None for k, v in inputs.items()}, dout.double(), False)[1]
    torch.testing.assert_close(grads[1].double(), want["delta"], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(grads[2].double(), want["A"], atol=1e-6, rtol=1e-4)


def test_states_shape_counts_256_step_chunks():
    assert ssc.states_shape(2, 6, 1, 16) == (2, 6, 0, 16)
    assert ssc.states_shape(2, 6, 256, 16) == (2, 6, 0, 16)
    assert ssc.states_shape(2, 6, 300, 16) == (2, 6, 1, 16)


def test_refuses_cpu_tensors_in_one_sentence():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ssc.selective_scan_cuda(**_inputs(dtype=torch.float32))


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or shutil.which("/usr/local/cuda/bin/nvcc")
    assert nvcc, "nvcc is not on PATH: the compile check needs the CUDA toolkit (e.g. /usr/local/bin/nvcc)"
    return nvcc


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """ptxas for sm_90 on the kernels: no error, no spill, the barrier count the design has (backward's one)."""
    result = subprocess.run([_nvcc(), "-arch=sm_90", "-cubin", "-O3", "--resource-usage", "-o", str(tmp_path / "k.cubin"),
                             str(ssc.SOURCE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    usage = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers, "
                       r"used (\d+) barriers", result.stdout + result.stderr, re.S)
    assert len(usage) == 6, result.stderr  # forward and backward for fp32, bf16, fp16
    for name, spills, _registers, barriers in usage:
        assert spills == "0", f"{name} spills"
        assert barriers == ("1" if "bwd" in name else "0"), name


@pytest.mark.slow
def test_extension_source_compiles_for_sm90(tmp_path):
    """The whole unit load_inline builds on a GPU (kernels + launchers against torch's headers), compiled to an
    object here with torch's own nvcc flags, so a typo in the launchers fails on the CPU, not on the first GPU run."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    source = tmp_path / "scan.cu"
    source.write_text(ssc.cuda_source())
    includes = [f"-I{p}" for p in include_paths(device_type="cuda") + [sysconfig.get_paths()["include"]]]
    result = subprocess.run([_nvcc(), "-c", "-std=c++20", "-arch=sm_90", "-O3", *COMMON_NVCC_FLAGS, *includes,
                             "-DTORCH_EXTENSION_NAME=tread_selective_scan_cuda", "-o", str(tmp_path / "scan.o"),
                             str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


@functools.cache
def _kernels_on_cpu(build_dir: str) -> ctypes.CDLL:
    """The .cu's kernels compiled for the CPU (tests/scan_cuda_on_cpu.cpp: a thread per CUDA thread)."""
    gxx = shutil.which("g++")
    assert gxx, "g++ is not on PATH: running the CUDA kernels on CPU threads needs a C++20 compiler"
    # The CUDA headers (cuda_bf16.h): beside the toolkit's nvcc, under CUDA_HOME, or /usr/local/cuda.
    roots = [Path(_nvcc()).resolve().parents[1], Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")), Path("/usr/local/cuda")]
    cuda_include = next((r / "include" for r in roots if (r / "include" / "cuda_bf16.h").exists()), None)
    assert cuda_include, f"no cuda_bf16.h under {[str(r) for r in roots]}: the CPU build of the kernels needs the CUDA headers"
    library = Path(build_dir) / "scan_cuda_on_cpu.so"
    result = subprocess.run([gxx, "-O1", "-std=c++20", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread",
                             f"-I{cuda_include}", "-o", str(library), str(Path(__file__).with_name("scan_cuda_on_cpu.cpp"))],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return ctypes.CDLL(str(library))


@pytest.mark.slow
@pytest.mark.parametrize("length,d,groups,n,dtype", [
    (1, 6, None, 4, torch.float32), (17, 6, 2, 4, torch.float32), (300, 8, None, 16, torch.float32),
    (256, 6, None, 4, torch.float32), (600, 70, 2, 2, torch.float32), (17, 6, 2, 4, torch.bfloat16),
    (264, 8, None, 4, torch.bfloat16)])
def test_cuda_kernels_on_cpu_threads_match_definition(tmp_path_factory, length, d, groups, n, dtype):
    """The kernels' own code, each CUDA thread a CPU thread (shuffles and barriers emulated), against the
    definition in fp64 on the same (rounded) inputs: forward, the stored chunk states' use, and every gradient
    (dB, dC from the block tiles). bf16 outputs and gradients are rounded to bf16, hence its tolerance."""
    lib = _kernels_on_cpu(str(tmp_path_factory.getbasetemp()))
    inputs = _inputs(d=d, length=length, n=n, groups=groups, dtype=dtype)
    dout = torch.randn(2, d, length).to(dtype)
    want, want_grads = _definition({k: v.double() for k, v in inputs.items()}, dout.double(), softplus=True)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    u, delta, A, B, C, D, z, bias = (t.contiguous() for t in inputs.values())
    Bg, Cg = (t if groups else t[:, None].contiguous() for t in (B, C))  # (b, n, l) -> (b, 1, n, l)
    g = Bg.shape[1]
    chunks = -(-length // ssc.CHUNK)
    out, states = torch.empty_like(u), torch.zeros(2, d, max(chunks - 1, 0), n)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    vec = length * u.element_size() % 16 == 0  # as the launcher decides (torch's CPU tensors are 64-byte aligned)
    shape = [ctypes.c_int(v) for v in (2, d, g, length, n, 1, int(vec), int(dtype == torch.bfloat16))]
    lib.scan_fwd(*map(ptr, (u, delta, z, Bg, Cg, A, D, bias, out, states)), *shape)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    blocks = lib.channel_blocks(d, g)
    du, ddelta, dz = torch.empty_like(u), torch.empty_like(u), torch.empty_like(u)
    dA, dD, dbias = torch.empty(2, d, n), torch.empty(2, d), torch.empty(2, d)
    dB, dC = torch.empty(2, g, blocks, n, length), torch.empty(2, g, blocks, n, length)
    lib.scan_bwd(*map(ptr, (u, delta, z, Bg, Cg, A, D, bias, dout, states, du, ddelta, dz, dA, dD, dbias, dB, dC)),
                 *shape)
    dB, dC = (t.sum(2).view(B.shape) for t in (dB, dC))  # (b, g, blocks, n, l) -> B's shape
    grads = dict(u=du, delta=ddelta, A=dA.sum(0), B=dB, C=dC, D=dD.sum(0), z=dz, delta_bias=dbias.sum(0))
    for name, got in grads.items():
        ref = want_grads[name]
        scale = ref.abs().max().clamp(min=1)
        torch.testing.assert_close(got.double() / scale, ref / scale, atol=tol, rtol=tol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("length,groups,d", [(1, None, 6), (17, 2, 6), (300, None, 8), (256, None, 64), (600, 2, 70)])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_kernels_match_reference(dtype, tol, length, groups, d, backend):
    from backbones.ops.cuda_kernels import scan_implementation

    inputs = {k: v.requires_grad_() for k, v in _inputs(d=d, length=length, n=16, groups=groups, dtype=dtype,
                                                          device="cuda").items()}
    out = ssc.selective_scan_cuda(**inputs, delta_softplus=True)
    want = scan_implementation(backend)(**inputs, delta_softplus=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(inputs.values()), dout)
    want_grads = torch.autograd.grad(want, list(inputs.values()), dout)
    for name, got, ref in zip(NAMES, grads, want_grads):
        assert got.dtype == ref.dtype, name
        scale = ref.float().abs().max().clamp(min=1)  # sums over the batch and channels grow with them
        torch.testing.assert_close(got.float() / scale, ref.float() / scale, atol=tol, rtol=tol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


def test_dispatch_names_the_cuda_backend(monkeypatch):
    from backbones.ops.cuda_kernels import resolve_backend, scan_implementation

    assert resolve_backend("cuda", on_cuda=True) == "cuda"
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "cuda")
    assert resolve_backend(None, on_cuda=True) == "cuda"
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        resolve_backend(None, on_cuda=False)
    assert scan_implementation("cuda") is ssc.selective_scan_cuda


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_custom_op_runs_the_cuda_kernels(compiled):
    """The custom op (what torch.compile sees) with backend="cuda" against the eager CUDA scan."""
    from backbones.ops.selective_scan_op import selective_scan_compilable

    inputs = {k: v.requires_grad_() for k, v in _inputs(d=8, length=300, n=16, dtype=torch.float32, device="cuda").items()}
    op = torch.compile(selective_scan_compilable, fullgraph=True) if compiled else selective_scan_compilable
    out = op(**inputs, delta_softplus=True, backend="cuda")
    want = ssc.selective_scan_cuda(**inputs, delta_softplus=True)
    torch.testing.assert_close(out, want)
    dout = torch.randn_like(out)
    for name, got, ref in zip(NAMES, torch.autograd.grad(out, list(inputs.values()), dout),
                              torch.autograd.grad(want, list(inputs.values()), dout)):
        torch.testing.assert_close(got, ref, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("change,message", [
    (dict(delta=torch.zeros(2, 6, 16)), "delta has shape"),
    (dict(A=torch.zeros(5, 4)), "A has shape"),
    (dict(z=torch.zeros(2, 6)), "z has shape"),
    (dict(D=torch.zeros(4)), "D has shape"),
    (dict(u=torch.zeros(2, 6, 0), delta=torch.zeros(2, 6, 0)), "length >= 1"),
    (dict(u=torch.zeros(6, 17)), "length >= 1"),
    (dict(B=torch.zeros(2, 4, 4, 17), C=torch.zeros(2, 4, 4, 17)), "not divisible"),
    (dict(A=torch.zeros(6, 65)), "at most 64 states"),
    (dict(u=torch.zeros(2, 6, 17, dtype=torch.float64)), "float32, bfloat16 or float16"),
])
def test_bad_arguments_get_one_sentence(change, message):
    inputs = _inputs(dtype=torch.float32) | change
    if "A" in change and change["A"].shape[1] == 65:
        inputs |= dict(B=torch.zeros(2, 65, 17), C=torch.zeros(2, 65, 17))
    with pytest.raises(ValueError, match=message):
        ssc.prepare(**inputs)


def test_custom_op_fake_gives_the_cuda_kernels_shapes():
    """What torch.compile traces for backend="cuda" (fake CUDA tensors, no GPU needed): out like u, and the states
    the CUDA forward stores, (b, d, chunks - 1, n) in fp32 at 256-step chunks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import backbones.ops.selective_scan_op  # noqa: F401 - registers torch.ops.tread.selective_scan

    with FakeTensorMode():
        u = torch.empty(2, 6, 300, device="cuda", dtype=torch.bfloat16)
        A, B = torch.empty(6, 16, device="cuda"), torch.empty(2, 16, 300, device="cuda", dtype=torch.bfloat16)
        out, states = torch.ops.tread.selective_scan(u, u, A, B, B, None, None, None, True, "cuda")
    assert (out.shape, out.dtype) == (u.shape, torch.bfloat16)
    assert (tuple(states.shape), states.dtype) == (ssc.states_shape(2, 6, 300, 16), torch.float32) == ((2, 6, 1, 16), torch.float32)


def test_missing_nvcc_is_one_sentence(monkeypatch):
    from torch.utils import cpp_extension

    from routing.errors import ConfigError

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="needs nvcc"):
        ssc.check_compiler()


@pytest.mark.parametrize("missing", ["ninja", "libcudart"])
def test_what_load_inline_would_fail_on_minutes_in_is_one_sentence_first(monkeypatch, tmp_path, missing):
    from torch.utils import cpp_extension

    from routing.errors import ConfigError

    home = tmp_path / "cuda"  # nvcc where CUDA_HOME says, the rest as the case has it
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").touch()
    (home / "lib64").mkdir()
    if missing != "libcudart":
        (home / "lib64" / "libcudart.so").touch()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(home))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: missing != "ninja")
    with pytest.raises(ConfigError, match="needs ninja" if missing == "ninja" else "has no lib64/libcudart.so"):
        ssc.check_compiler()
