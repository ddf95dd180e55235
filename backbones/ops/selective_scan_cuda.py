"""Selective scan (Mamba's S6 recurrence) as CUDA kernels with mamba-ssm's structure, forward and backward.

Same signature and semantics as `backbones.ops.selective_scan.selective_scan` (mamba-ssm's `selective_scan_fn`
for real A and input-dependent B, C); u, delta, z: (b, d, l); A: (d, n); B, C: (b, n, l) or grouped
(b, g, n, l); D, delta_bias: (d,). Inputs fp32, bf16 or fp16 (fp32 math); each gradient in its input's dtype.

The kernels are in selective_scan_cuda.cu (its header says how they work: a warp per channel, a lane per 8
consecutive steps of a 256-step chunk, a warp scan of lane aggregates, dB / dC summed per block in shared memory
and written once). Triton has no lane shuffle and no explicit shared memory, which that structure needs, hence
CUDA. `torch.utils.cpp_extension.load_inline` compiles them on the first call (about a minute, then cached in
torch's extension directory), so importing this module needs no compiler and no GPU. The same algorithm in
torch, tested on the CPU, is backbones/ops/selective_scan_lanes.py; on a GPU tests/test_selective_scan_cuda.py
compares these kernels with the Triton and PyTorch scans. Select it with TREAD_SCAN_BACKEND=cuda.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from backbones.ops.autocast import fp32_operator
from routing.errors import ConfigError

SOURCE = Path(__file__).with_suffix(".cu")
CHUNK = 256  # steps per chunk: 32 lanes x 8 steps (CHUNK in the .cu)
WARPS = 4  # channels per block (WARPS in the .cu)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_STATES = 64  # backward's shared memory: 16 KiB of rows + 2 KiB per state of dB, dC tile (+ carries)

# Host side: build the kernels' Params from tensors and launch on the current stream.
_LAUNCHERS = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

using tread_scan::Params;

static const void* ptr(const std::optional<at::Tensor>& t) { return t ? t->data_ptr() : nullptr; }
static bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16-byte vector loads and stores need every (b, d, l) / (b, g, n, l) row to start on a 16-byte boundary.
static bool vectorisable(const Params& p, size_t elem) {
  if ((p.length * elem) % 16) return false;
  for (const void* q : {p.u, p.delta, p.z, p.B, p.C, p.dout, (const void*)p.out, (const void*)p.du,
                        (const void*)p.ddelta, (const void*)p.dz})
    if (q && !aligned(q)) return false;
  return true;
}

static Params params(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                     const at::Tensor& C, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& z,
                     const std::optional<at::Tensor>& delta_bias, bool softplus) {
  Params p{};
  p.u = u.data_ptr(); p.delta = delta.data_ptr(); p.z = ptr(z); p.B = B.data_ptr(); p.C = C.data_ptr();
  p.A = A.data_ptr<float>();
  p.D = D ? D->data_ptr<float>() : nullptr;
  p.delta_bias = delta_bias ? delta_bias->data_ptr<float>() : nullptr;
  p.batch = u.size(0); p.d = u.size(1); p.length = u.size(2); p.groups = B.size(1); p.n = A.size(1);
  p.chunks = (p.length + tread_scan::CHUNK - 1) / tread_scan::CHUNK;
  const int k = p.d / p.groups;
  p.fwd_blocks = (k + tread_scan::WARPS - 1) / tread_scan::WARPS;
  // Backward: a block sums dB, dC over up to 32 channels (8 rounds of its 4 warps), so the partials it writes are
  // 1/32 of the per-channel terms; fewer rounds when the group has fewer channels.
  p.rounds = std::min(8, p.fwd_blocks);
  p.channel_blocks = (k + tread_scan::WARPS * p.rounds - 1) / (tread_scan::WARPS * p.rounds);
  p.softplus = softplus;
  return p;
}

template <typename T> static void launch_fwd(const Params& p, bool vec) {
  dim3 grid(p.groups * p.fwd_blocks, p.batch);
  tread_scan::scan_fwd_kernel<T><<<grid, tread_scan::WARPS * 32, tread_scan::fwd_smem(p.n),
                                   c10::cuda::getCurrentCUDAStream()>>>(p, vec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T> static void launch_bwd(const Params& p, bool vec) {
  dim3 grid(p.groups * p.channel_blocks, p.batch);
  auto kernel = tread_scan::scan_bwd_kernel<T>;
  size_t smem = tread_scan::bwd_smem(p.n, p.rounds);
  static size_t allowed = 48 * 1024;  // dynamic shared memory this kernel may take without opting in; raised once
  if (smem > allowed) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    allowed = smem;
  }
  kernel<<<grid, tread_scan::WARPS * 32, smem, c10::cuda::getCurrentCUDAStream()>>>(p, vec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename F> static void by_dtype(at::ScalarType t, F f) {
  if (t == at::kFloat) f(float{});
  else if (t == at::kBFloat16) f(__nv_bfloat16{});
  else if (t == at::kHalf) f(__half{});
  else TORCH_CHECK(false, "selective scan (cuda): inputs must be float32, bfloat16 or float16");
}

std::vector<at::Tensor> scan_fwd(at::Tensor u, at::Tensor delta, at::Tensor A, at::Tensor B, at::Tensor C,
                                 std::optional<at::Tensor> D, std::optional<at::Tensor> z,
                                 std::optional<at::Tensor> delta_bias, bool softplus, bool store) {
  const c10::cuda::CUDAGuard guard(u.device());
  Params p = params(u, delta, A, B, C, D, z, delta_bias, softplus);
  auto out = torch::empty_like(u);
  auto states = torch::empty({store ? p.batch : 0, p.d, p.chunks - 1, p.n}, A.options());
  p.out = out.data_ptr();
  p.states = store ? states.data_ptr<float>() : nullptr;
  const bool vec = vectorisable(p, u.element_size());
  by_dtype(u.scalar_type(), [&](auto t) { launch_fwd<decltype(t)>(p, vec); });
  return {out, states};
}

std::vector<at::Tensor> scan_bwd(at::Tensor dout, at::Tensor u, at::Tensor delta, at::Tensor A, at::Tensor B,
                                 at::Tensor C, std::optional<at::Tensor> D, std::optional<at::Tensor> z,
                                 std::optional<at::Tensor> delta_bias, bool softplus, at::Tensor states) {
  const c10::cuda::CUDAGuard guard(u.device());
  Params p = params(u, delta, A, B, C, D, z, delta_bias, softplus);
  auto f32 = A.options();
  auto du = torch::empty_like(u), ddelta = torch::empty_like(delta);
  auto dz = z ? torch::empty_like(*z) : torch::empty({0}, u.options());
  auto dA = torch::empty({p.batch, p.d, p.n}, f32);
  auto dD = torch::empty({D ? p.batch : 0, p.d}, f32), dbias = torch::empty({delta_bias ? p.batch : 0, p.d}, f32);
  auto dB = torch::empty({p.batch, p.groups, p.channel_blocks, p.n, p.length}, f32), dC = torch::empty_like(dB);
  p.dout = dout.data_ptr(); p.states = p.chunks > 1 ? states.data_ptr<float>() : nullptr;
  p.du = du.data_ptr(); p.ddelta = ddelta.data_ptr(); p.dz = z ? dz.data_ptr() : nullptr;
  p.dA = dA.data_ptr<float>(); p.dD = D ? dD.data_ptr<float>() : nullptr;
  p.dbias = delta_bias ? dbias.data_ptr<float>() : nullptr;
  p.dB = dB.data_ptr<float>(); p.dC = dC.data_ptr<float>();
  const bool vec = vectorisable(p, u.element_size());
  by_dtype(u.scalar_type(), [&](auto t) { launch_bwd<decltype(t)>(p, vec); });
  return {du, ddelta, dA, dB, dC, dD, dz, dbias};
}
"""

_DECLARATIONS = """
std::vector<at::Tensor> scan_fwd(at::Tensor u, at::Tensor delta, at::Tensor A, at::Tensor B, at::Tensor C,
                                 std::optional<at::Tensor> D, std::optional<at::Tensor> z,
                                 std::optional<at::Tensor> delta_bias, bool softplus, bool store);
std::vector<at::Tensor> scan_bwd(at::Tensor dout, at::Tensor u, at::Tensor delta, at::Tensor A, at::Tensor B,
                                 at::Tensor C, std::optional<at::Tensor> D, std::optional<at::Tensor> z,
                                 std::optional<at::Tensor> delta_bias, bool softplus, at::Tensor states);
"""


def cuda_source() -> str:
    """The whole translation unit load_inline compiles: the kernels, then the launchers."""
    return SOURCE.read_text() + _LAUNCHERS


def check_compiler() -> None:
    """Refuses in one sentence what load_inline's first build would fail on, minutes in: no nvcc, no ninja, or a
    CUDA_HOME (torch takes it from nvcc's folder when unset) without the CUDA runtime library it links."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if not (home and (Path(home) / "bin" / "nvcc").exists()) and shutil.which("nvcc") is None:
        raise ConfigError("TREAD_SCAN_BACKEND=cuda builds its kernels on first use and needs nvcc, which is not on "
                          "PATH or under CUDA_HOME; install the CUDA toolkit (or set CUDA_HOME), or use "
                          "TREAD_SCAN_BACKEND=triton.")
    if not cpp_extension.is_ninja_available():
        raise ConfigError("TREAD_SCAN_BACKEND=cuda builds its kernels with torch's load_inline, which needs ninja on PATH; "
                          "pip install ninja (or put its binary on PATH), or use TREAD_SCAN_BACKEND=triton.")
    if home and not any((Path(home) / lib / "libcudart.so").exists() for lib in ("lib64", "lib")):
        raise ConfigError(f"TREAD_SCAN_BACKEND=cuda links the CUDA runtime from CUDA_HOME, but {home} has no "
                          "lib64/libcudart.so (torch took the folder from nvcc's); set CUDA_HOME to the CUDA toolkit's "
                          "folder (the one holding bin/nvcc and lib64), or use TREAD_SCAN_BACKEND=triton.")


@functools.cache
def extension():
    """The compiled kernels (built on the first call, then loaded from torch's extension cache)."""
    from torch.utils.cpp_extension import load_inline

    check_compiler()
    return load_inline(name="tread_selective_scan_cuda", cpp_sources=_DECLARATIONS, cuda_sources=cuda_source(),
                       functions=["scan_fwd", "scan_bwd"], extra_cuda_cflags=["-O3"])


def chunks(length: int) -> int:
    return -(-length // CHUNK)


def states_shape(b: int, d: int, length: int, n: int) -> tuple[int, int, int, int]:
    """Shape of the chunk states forward keeps for backward: (b, d, chunks - 1, n)."""
    return b, d, chunks(length) - 1, n


def prepare(u, delta, A, B, C, D=None, z=None, delta_bias=None):
    """Checks the arguments (one sentence per fault); returns the kernels' inputs: contiguous, B and C grouped
    (b, g, n, l), delta / B / C / z in u's dtype, A / D / delta_bias in fp32."""
    if u.dtype not in DTYPES:
        raise ValueError(f"the cuda selective scan takes float32, bfloat16 or float16 inputs, got {u.dtype}; "
                         "use TREAD_SCAN_BACKEND=triton or torch for float64")
    if u.dim() != 3 or u.shape[2] == 0:
        raise ValueError(f"u must be (batch, channels, length) with length >= 1, got {tuple(u.shape)}")
    b, d, length = u.shape
    if B.dim() != C.dim() or B.dim() not in (3, 4):
        raise ValueError(f"B and C must both be (b, n, l) or (b, g, n, l); got {tuple(B.shape)} and {tuple(C.shape)}")
    if B.dim() == 3:
        B, C = B[:, None], C[:, None]  # (b, n, l) -> (b, 1, n, l)
    g, n = B.shape[1], A.shape[-1]
    expected = {"delta": (delta, (b, d, length)), "A": (A, (d, n)), "B": (B, (b, g, n, length)),
                "C": (C, (b, g, n, length)), "D": (D, (d,)), "z": (z, (b, d, length)), "delta_bias": (delta_bias, (d,))}
    for name, (t, shape) in expected.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} where u {tuple(u.shape)} and A {tuple(A.shape)} "
                             f"need {shape}")
    if d % g:
        raise ValueError(f"channels d={d} are not divisible by the {g} groups of B and C")
    if n > MAX_STATES:
        raise ValueError(f"the cuda selective scan takes at most {MAX_STATES} states (its backward keeps an (n, 512) "
                         f"tile in shared memory), got n={n}; use TREAD_SCAN_BACKEND=triton")
    if not u.is_cuda:
        raise ValueError("the cuda selective scan needs CUDA tensors; on a CPU use TREAD_SCAN_BACKEND=torch")
    act = lambda t: t.to(u.dtype).contiguous() if t is not None else None  # noqa: E731
    fp32 = lambda t: t.float().contiguous() if t is not None else None  # noqa: E731
    return u.contiguous(), act(delta), fp32(A), act(B), act(C), fp32(D), act(z), fp32(delta_bias)


@fp32_operator
def scan_forward(u, delta, A, B, C, D, z, delta_bias, delta_softplus: bool, store: bool):
    """Forward launch on prepared inputs: out (u's dtype) and the chunk states ((b, d, chunks - 1, n) if `store`)."""
    out, states = extension().scan_fwd(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), store)
    return out, states


@fp32_operator
def scan_backward(dout, u, delta, A, B, C, D, z, delta_bias, delta_softplus: bool, states):
    """Backward launch on the inputs scan_forward took and its states: (du, ddelta, dA, dB, dC, dD, dz, dbias).

    du, ddelta, dz, dB, dC in the activations' dtype ((b, g, n, l) for B, C); dA, dD, dbias fp32; absent -> None.
    """
    du, ddelta, dA, dB, dC, dD, dz, dbias = extension().scan_bwd(
        dout.to(u.dtype).contiguous(), u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), states)
    # Sums the kernel leaves to torch: over the batch (A, D, delta_bias) and the channel blocks (B, C).
    dB, dC = dB.sum(2).to(B.dtype), dC.sum(2).to(C.dtype)  # (b, g, blocks, n, l) -> (b, g, n, l)
    return (du, ddelta, dA.sum(0), dB, dC, dD.sum(0) if D is not None else None, dz if z is not None else None,
            dbias.sum(0) if delta_bias is not None else None)


class _CudaScan(torch.autograd.Function):
    """The CUDA scan in eager mode on the original inputs (the custom op is the compiled path)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, store):
        originals = (u, delta, A, B, C, D, z, delta_bias)
        inputs = prepare(*originals)
        out, states = scan_forward(*inputs, delta_softplus, store)
        if store:
            ctx.save_for_backward(*inputs, states)
            ctx.delta_softplus = delta_softplus
            ctx.dtypes = [t.dtype if t is not None else None for t in originals]
            ctx.shapes = (B.shape, C.shape)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        *inputs, states = ctx.saved_tensors
        grads = list(scan_backward(dout, *inputs, ctx.delta_softplus, states))
        grads[3], grads[4] = grads[3].view(ctx.shapes[0]), grads[4].view(ctx.shapes[1])  # ungrouped: (b, 1, n, l) -> (b, n, l)
        grads = [g.to(dt) if g is not None else None for g, dt in zip(grads, ctx.dtypes)]
        return *grads, None, None


def selective_scan_cuda(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus: bool = False):
    """The selective scan as CUDA kernels (compiled on first use); fp32 state, returns u's dtype."""
    # Without a gradient to compute, forward skips storing the chunk states.
    store = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (u, delta, A, B, C, D, z, delta_bias))
    return _CudaScan.apply(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), store)
