"""Keep mixed precision out of the scan operators."""

from __future__ import annotations

import functools

import torch


def fp32_operator(fn):
    """Run `fn` with autocast off on the device of its first tensor argument.

    The scans cast their inputs to fp32 themselves and are exact only there; under autocast their
    internal matmuls would drop to bf16 and mix dtypes (and, on CPU, the backward runs under autocast too).
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        with torch.autocast(device_type=first.device.type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper
