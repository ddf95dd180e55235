"""The selective scan as a PyTorch custom op (torch.library): what torch.compile sees of the scan.

    torch.ops.tread.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, backend) -> (out, states)
    torch.ops.tread.selective_scan_backward(dout, u, ..., delta_bias, states, delta_softplus, backend) -> grads

Why an op: Dynamo cannot trace into a Triton launch, an autograd.Function holding one, or mamba-ssm's
extension, and breaks the graph there; an op with a fake implementation (output shapes from input
shapes) and a registered backward that is itself an op is one opaque node in the forward and in the
backward graph. So `trainer.compile=true` compiles a whole Mamba block as one graph, and Inductor fuses
the element-wise work around the scan (conv bias + SiLU, the flips, the z gate, residual adds).

`backend` is scan_fn's: "" reads TREAD_SCAN_BACKEND at run time, "auto" picks mamba-ssm / Triton / the
PyTorch scan by device (backbones/ops/cuda_kernels.py). The op runs:
- "triton" and "cuda": the fused kernels; forward returns the chunk states its backward rebuilds from.
- "torch" (every CPU tensor, so the op compiles in CI) and "mamba_ssm": the implementation's forward
  without autograd, and a backward that recomputes it with autograd (states is empty). Recomputing costs
  one more forward; eager mode (scan_fn outside torch.compile) calls these implementations directly and
  pays nothing.
"""

from typing import Optional

import torch
from torch import Tensor


def _path(backend: str, u: Tensor) -> str:
    from backbones.ops.cuda_kernels import resolve_backend  # cuda_kernels imports this module

    return resolve_backend(backend, u.is_cuda)


def _autograd_dispatch() -> torch._C._ForceDispatchKeyGuard:
    """Autograd inside an op's kernel: a compiled backward runs its ops below the autograd dispatch keys,
    where the recomputed forward would record no graph to differentiate."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradCPU", "AutogradCUDA", "ADInplaceOrView", "AutogradFunctionality"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, key))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _kernels(path: str):
    """The module of the fused kernels `path` names; both have prepare, scan_forward, scan_backward, states_shape."""
    if path == "cuda":
        from backbones.ops import selective_scan_cuda

        return selective_scan_cuda
    from backbones.ops import selective_scan_triton

    return selective_scan_triton


def _compute_dtype(u: Tensor) -> torch.dtype:
    return torch.float64 if u.dtype == torch.float64 else torch.float32


@torch.library.custom_op("tread::selective_scan", mutates_args=())
def selective_scan_op(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    delta_bias: Optional[Tensor], delta_softplus: bool, backend: str,
) -> tuple[Tensor, Tensor]:
    path = _path(backend, u)
    if path in ("triton", "cuda"):
        kernels = _kernels(path)
        inputs = kernels.prepare(u, delta, A, B, C, D, z, delta_bias)
        return kernels.scan_forward(*inputs, delta_softplus, store=True)
    from backbones.ops.cuda_kernels import scan_implementation

    with torch.no_grad():
        out = scan_implementation(path)(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    return out.contiguous(), u.new_empty(0)


@selective_scan_op.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, backend):
    states = u.new_empty(0)
    path = _path(backend, u)
    if path in ("triton", "cuda"):
        states = u.new_empty(_kernels(path).states_shape(*u.shape, A.shape[1]), dtype=_compute_dtype(u))
    return torch.empty_like(u, memory_format=torch.contiguous_format), states


@torch.library.custom_op("tread::selective_scan_backward", mutates_args=())
def selective_scan_backward_op(
    dout: Tensor, u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], delta_bias: Optional[Tensor], states: Tensor, delta_softplus: bool, backend: str,
) -> list[Tensor]:
    """Gradients of u, delta, A, B, C, D, z, delta_bias, each in its input's dtype; empty for an absent input."""
    inputs = (u, delta, A, B, C, D, z, delta_bias)
    path = _path(backend, u)
    if path in ("triton", "cuda"):
        kernels = _kernels(path)
        grads = list(kernels.scan_backward(dout, *kernels.prepare(*inputs), delta_softplus, states))
        grads[3], grads[4] = grads[3].view(B.shape), grads[4].view(C.shape)  # (b, 1, n, l) -> (b, n, l) if ungrouped
        if path == "triton":  # dB and dC (dD and dbias) are views of one sum; an op's outputs may not alias
            grads[4] = grads[4].clone()
            if grads[5] is not None and grads[7] is not None:
                grads[7] = grads[7].clone()
    else:
        from backbones.ops.cuda_kernels import scan_implementation

        with torch.enable_grad(), _autograd_dispatch():
            leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
            out = scan_implementation(path)(*leaves, delta_softplus)
            present = [t for t in leaves if t is not None]
            found = iter(torch.autograd.grad(out, present, dout, allow_unused=True))
            grads = [next(found) if t is not None else None for t in leaves]
        grads = [g if g is not None or t is None else torch.zeros_like(t) for g, t in zip(grads, inputs)]
    return [g.to(t.dtype).contiguous() if t is not None else u.new_empty(0) for g, t in zip(grads, inputs)]


@selective_scan_backward_op.register_fake
def _(dout, u, delta, A, B, C, D, z, delta_bias, states, delta_softplus, backend):
    inputs = (u, delta, A, B, C, D, z, delta_bias)
    return [torch.empty_like(t, memory_format=torch.contiguous_format) if t is not None else u.new_empty(0)
            for t in inputs]


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, backend = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, output[1])
    ctx.delta_softplus, ctx.backend = delta_softplus, backend


def _backward(ctx, dout, _dstates):
    u, delta, A, B, C, D, z, delta_bias, states = ctx.saved_tensors
    grads = torch.ops.tread.selective_scan_backward(dout.contiguous(), u, delta, A, B, C, D, z, delta_bias, states,
                                                    ctx.delta_softplus, ctx.backend)
    optional = (None, None, None, None, None, D, z, delta_bias)  # absent inputs get no gradient
    grads = [g if i < 5 or optional[i] is not None else None for i, g in enumerate(grads)]
    return *grads, None, None


selective_scan_op.register_autograd(_backward, setup_context=_setup_context)


def selective_scan_compilable(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor] = None,
    z: Optional[Tensor] = None, delta_bias: Optional[Tensor] = None, delta_softplus: bool = False,
    backend: str = "",
) -> Tensor:
    """scan_fn's semantics through the custom op: one graph node for torch.compile."""
    return torch.ops.tread.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, backend)[0]
