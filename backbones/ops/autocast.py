"""Keep mixed precision out of the scan operators."""

from __future__ import annotations

import functools

import torch


def fp32_operator(fn):
    """Run `fn(x, ...)` with autocast off.

    The scans cast their inputs to fp32 themselves and are exact only there; under autocast their
    internal matmuls would drop to bf16 and mix dtypes (and, on CPU, the backward runs under autocast too).
    """

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return fn(x, *args, **kwargs)

    return wrapper
