"""Bi-WKV as one PyTorch operator, `tread_zoo::bi_wkv`, with its backward `tread_zoo::bi_wkv_backward`.

Why an operator. torch.compile cannot trace into a Triton launch with an autotuner, nor into the chunked op
(its chunk length is read from w on the host), so without an operator a compiled RWKV block breaks its graph
at every Bi-WKV and Inductor cannot fuse the elementwise work on either side (token shift, lerp, the sigmoid
gate, the LayerNorm). As a torch.library op with a fake (shape-only) implementation, Dynamo keeps it as one
node; its backward is an op too, so the compiled backward graph has no break either.

One op for both paths: `use_triton` picks the Triton kernels (CUDA, or CPU through Triton's interpreter) or
the chunked PyTorch op. The forward returns y and a state tensor the backward needs: the kernels' chunk
carries (6, B, n, C); the chunked path returns an empty state and recomputes its forward in the backward.
The op runs only under torch.compile: in eager mode bi_wkv calls each path's autograd.Function directly
(wkv_triton._TritonBiWKV, wkv._BiWKV), which skips the dispatcher's work on every call.
"""

from __future__ import annotations

import torch

from backbones.ops.wkv import chunked_backward, chunked_forward


def _kernels():
    # Imported on first use: triton is optional on machines that never run the kernels.
    from backbones.ops import wkv_triton

    return wkv_triton


@torch.library.custom_op("tread_zoo::bi_wkv", mutates_args=())
def bi_wkv_op(
    w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_len: int, use_triton: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """y (B, T, C) and the state for the backward. Triton: w, u fp32, k, v contiguous of one dtype; chunked:
    all four in one float dtype (see backbones.ops.wkv.bi_wkv, which prepares them)."""
    if use_triton:
        return _kernels().forward(w, u, k, v)
    y, _, _ = chunked_forward(w, u, k, v, chunk_len)
    # Contiguous, as the fake says: compiled code trusts the fake's strides.
    return y.contiguous(), k.new_empty(0, dtype=torch.float32)


@bi_wkv_op.register_fake
def _(w, u, k, v, chunk_len, use_triton):
    B, T, C = k.shape
    if not use_triton:
        return k.new_empty(B, T, C), k.new_empty(0, dtype=torch.float32)
    n = -(-T // _kernels().chunk_len(T))
    return k.new_empty(B, T, C), k.new_empty(6, B, n, C, dtype=torch.float32)


@torch.library.custom_op("tread_zoo::bi_wkv_backward", mutates_args=())
def bi_wkv_backward_op(
    w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, grad_y: torch.Tensor,
    chunk_len: int, use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dw, du, dk, dv of bi_wkv_op."""
    if use_triton:
        du_dw, dk, dv = _kernels().backward(w, u, k, v, state, grad_y)
        return du_dw[1].clone(), du_dw[0].clone(), dk, dv  # an op's outputs may not alias each other
    _, saved, (T, L) = chunked_forward(w, u, k, v, chunk_len)
    dw, du, dk, dv = chunked_backward(saved, T, L, grad_y.contiguous())
    # Contiguous as the fake says (du is a column of a table); dk and dv are views of one buffer, and an op's
    # outputs may not alias each other.
    return dw.contiguous(), du.contiguous(), dk.contiguous(), dv.clone(memory_format=torch.contiguous_format)


@bi_wkv_backward_op.register_fake
def _(w, u, k, v, state, grad_y, chunk_len, use_triton):
    return torch.empty_like(w), torch.empty_like(u), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    w, u, k, v, ctx.chunk_len, ctx.use_triton = inputs
    ctx.save_for_backward(w, u, k, v, output[1])


def _backward(ctx, grad_y, _grad_state):
    w, u, k, v, state = ctx.saved_tensors
    grads = bi_wkv_backward_op(w, u, k, v, state, grad_y, ctx.chunk_len, ctx.use_triton)
    return *grads, None, None


bi_wkv_op.register_autograd(_backward, setup_context=_setup_context)
