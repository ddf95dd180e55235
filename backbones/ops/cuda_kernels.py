"""Dispatch the Mamba ops to the mamba-ssm / causal-conv1d CUDA kernels when they are installed and the
tensors are on CUDA, and to our pure-PyTorch ops otherwise.

The kernels come with the `cuda` extra (`pip install -e '.[cuda]'`). They are imported lazily, on the first
call with CUDA tensors, and guarded with `except Exception`: importing mamba_ssm raises more than
ImportError (e.g. an undefined symbol) on a machine where its compiled extension does not match.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from backbones.ops.causal_conv import causal_conv1d
from backbones.ops.selective_scan import selective_scan

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
) -> torch.Tensor:
    """selective_scan_fn semantics (see backbones/ops/selective_scan.py) on the fastest available path."""
    kernel = cuda_selective_scan() if u.is_cuda else None
    if kernel is not None:
        _announce("selective scan: mamba-ssm CUDA kernel")
        return kernel(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
    _announce("selective scan: pure-PyTorch chunked scan")
    return selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus)


def conv_fn(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """causal_conv1d_fn semantics (see backbones/ops/causal_conv.py) on the fastest available path."""
    kernel = cuda_causal_conv1d() if x.is_cuda else None
    if kernel is not None:
        _announce("causal conv1d: causal-conv1d CUDA kernel")
        return kernel(x, weight, bias, activation=activation)
    _announce("causal conv1d: pure-PyTorch F.conv1d")
    return causal_conv1d(x, weight, bias, activation)
