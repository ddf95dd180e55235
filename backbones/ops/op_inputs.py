"""Checks on the arguments of the ops' public entry points (the selective scan, Bi-WKV).

Why here and not in the kernels: a kernel reads whatever its pointers and integers say, so a delta of the
wrong length or a v of another shape returns finite garbage or reads out of bounds, and a 2-D input or an empty
sequence fails deep in a launch with a message about something else. Each check is a few attribute reads on the
host (no device read), and each refusal is one sentence naming the argument, what it got and what it needs.
"""

from __future__ import annotations

import torch

from routing.errors import ConfigError


class OpInputError(ConfigError):
    """An op's argument of the wrong shape, dtype or device (a ValueError; the commands print it as one line)."""


def check_float(op: str, device: torch.device, **tensors: torch.Tensor | None) -> None:
    """Every given tensor is a real floating-point tensor on `device` (None: an absent optional input)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise OpInputError(f"{op}: {name} must be a tensor, got {type(t).__name__}.")
        if not t.is_floating_point():
            raise OpInputError(f"{op}: {name} has dtype {t.dtype}; pass a floating-point tensor (float32, bfloat16, "
                               f"float16 or float64).")
        if t.device != device:
            raise OpInputError(f"{op}: {name} is on {t.device} but the input is on {device}; move every argument to "
                               f"one device.")


def check_shape(op: str, name: str, t: torch.Tensor | None, shape: tuple[int, ...], layout: str) -> None:
    """t (when given) has exactly `shape`; `layout` names the dimensions, e.g. "(d,)"."""
    if t is not None and tuple(t.shape) != tuple(shape):
        raise OpInputError(f"{op}: {name} has shape {tuple(t.shape)}, expected {layout} = {tuple(shape)}.")
