"""Dispatch the Mamba ops to the fastest available implementation for the tensors' device.

Selective scan, `backend="auto"` (the default):
1. CUDA tensors with mamba-ssm importable: its `selective_scan_fn`, the upstream kernel, tuned and the one
   published Mamba numbers come from (our Triton kernel's speed against it is not yet measured).
2. CUDA tensors otherwise: our fused Triton kernel (`backbones/ops/selective_scan_triton.py`); Triton
   ships with torch, so this is the usual GPU path.
3. CPU tensors, or CUDA without Triton: our pure-PyTorch scan (`backbones/ops/selective_scan.py`).
`backend="cuda"`: our CUDA kernels with mamba-ssm's structure (`backbones/ops/selective_scan_cuda.py`, compiled on
the first call); opt-in only, "auto" does not pick them until a GPU has timed them.
`backend="mamba_ssm" | "cuda" | "triton" | "torch"` forces one (an error if it cannot run); the environment
variable TREAD_SCAN_BACKEND sets the default, so a training run can be switched without code changes.
Under torch.compile `scan_fn` calls the custom op `torch.ops.tread.selective_scan` (selective_scan_op.py),
which makes the same choice when it runs, and `conv_fn` the PyTorch conv, so a Mamba block is one graph.
`backend="triton"` on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1; tests only).

The CUDA kernels come with the `cuda` extra (`pip install -e '.[cuda]'`). They, and Triton, are imported
lazily, on the first call that wants them, and guarded with `except Exception`: importing mamba_ssm raises
more than ImportError (e.g. an undefined symbol) on a machine where its compiled extension does not match.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from backbones.ops.causal_conv import causal_conv1d
from backbones.ops.selective_scan import selective_scan
from backbones.ops.selective_scan_op import selective_scan_compilable

log = logging.getLogger(__name__)


@functools.cache
def _announce(message: str) -> None:
    """Log each dispatch choice once per process."""
    log.info(message)


@functools.cache
def cuda_selective_scan() -> Callable | None:
    """mamba-ssm's selective_scan_fn, or None when it cannot be imported."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception as err:  # noqa: BLE001 - any failure means "use ours"
        log.info("mamba-ssm unavailable (%s: %s)", type(err).__name__, err)
        return None
    return selective_scan_fn


@functools.cache
def cuda_causal_conv1d() -> Callable | None:
    """causal-conv1d's causal_conv1d_fn, or None when it cannot be imported."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except Exception as err:  # noqa: BLE001 - any failure means "use ours"
        log.info("causal-conv1d unavailable (%s: %s)", type(err).__name__, err)
        return None
    return causal_conv1d_fn


@functools.cache
def triton_selective_scan() -> Callable | None:
    """Our Triton selective scan, or None when Triton cannot be imported."""
    try:
        from backbones.ops.selective_scan_triton import selective_scan_triton
    except Exception as err:  # noqa: BLE001 - any failure means "use the PyTorch scan"
        log.info("Triton unavailable (%s: %s)", type(err).__name__, err)
        return None
    return selective_scan_triton


SCAN_BACKENDS = ("auto", "mamba_ssm", "cuda", "triton", "torch")


def resolve_backend(backend: str | None, on_cuda: bool) -> str:
    """The implementation `backend` names for tensors on CUDA or not: "mamba_ssm", "triton" or "torch".

    backend: one of SCAN_BACKENDS; None or "" reads TREAD_SCAN_BACKEND (default "auto", see the module docstring).
    """
    backend = backend or os.environ.get("TREAD_SCAN_BACKEND", "auto")
    if backend not in SCAN_BACKENDS:
        raise ValueError(f"selective scan backend must be one of {SCAN_BACKENDS}, got {backend!r}")
    if backend in ("auto", "mamba_ssm"):
        if on_cuda and cuda_selective_scan() is not None:
            return "mamba_ssm"
        if backend == "mamba_ssm":
            raise RuntimeError("backend='mamba_ssm' needs CUDA tensors and mamba-ssm (pip install -e '.[cuda]')")
    if backend == "cuda":
        if not on_cuda:
            raise RuntimeError("backend='cuda' needs CUDA tensors; on a CPU use 'torch'")
        return "cuda"
    if backend == "triton" or (backend == "auto" and on_cuda):
        if triton_selective_scan() is not None:
            return "triton"
        if backend == "triton":
            raise RuntimeError("backend='triton' needs Triton, which ships with torch; `import triton` failed")
    return "torch"


_SCAN_NAMES = {"mamba_ssm": "mamba-ssm CUDA kernel", "cuda": "our CUDA kernel", "triton": "Triton kernel",
               "torch": "pure-PyTorch chunked scan"}


def _our_cuda_scan() -> Callable:
    from backbones.ops.selective_scan_cuda import selective_scan_cuda  # compiles nothing until called

    return selective_scan_cuda


def scan_implementation(path: str) -> Callable:
    """The function `resolve_backend`'s answer names (selective_scan_fn's positional signature); logs it once."""
    _announce(f"selective scan: {_SCAN_NAMES[path]}")
    return {"mamba_ssm": cuda_selective_scan, "cuda": _our_cuda_scan, "triton": triton_selective_scan}.get(
        path, lambda: selective_scan)()


def scan_fn(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """selective_scan_fn semantics (see backbones/ops/selective_scan.py) on the path `backend` names.

    backend: one of SCAN_BACKENDS; None reads TREAD_SCAN_BACKEND (default "auto", see the module docstring).
    Under torch.compile the call becomes the custom op torch.ops.tread.selective_scan (selective_scan_op.py),
    which resolves the backend the same way when it runs: one graph node instead of a graph break.
    """
    if torch.compiler.is_compiling():
        return selective_scan_compilable(u, delta, A, B, C, D, z, delta_bias, delta_softplus, backend or "")
    path = resolve_backend(backend, u.is_cuda)
    return scan_implementation(path)(u, delta, A, B, C, D, z, delta_bias, delta_softplus)


def conv_fn(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """causal_conv1d_fn semantics (see backbones/ops/causal_conv.py) on the fastest available path."""
    # Under torch.compile the PyTorch conv: Inductor fuses its padding, bias and SiLU, where the extension's
    # autograd.Function would break the graph.
    if torch.compiler.is_compiling():
        return causal_conv1d(x, weight, bias, activation)
    kernel = cuda_causal_conv1d() if x.is_cuda else None
    if kernel is not None:
        _announce("causal conv1d: causal-conv1d CUDA kernel")
        return kernel(x, weight, bias, activation=activation)
    _announce("causal conv1d: pure-PyTorch F.conv1d")
    return causal_conv1d(x, weight, bias, activation)
