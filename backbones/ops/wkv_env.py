"""TREAD_WKV_KERNEL: which Triton Bi-WKV kernels run, `chunked` (three launches per pass, backbones/ops/wkv_triton.py;
the default) or `fused` (one launch per pass, backbones/ops/wkv_triton_fused.py). Both take and give the same chunk
carries, so the switch changes no saved state. Read at every Triton Bi-WKV call (one dictionary lookup) and checked
when a command starts (backbones/ops/selective_scan_env.check_scan_environment), so a typo is one sentence before
any work, not a failure at the first RWKV step.
"""

from __future__ import annotations

import os

from routing.errors import ConfigError

WKV_KERNELS = ("chunked", "fused")


def wkv_kernel() -> str:
    """The Triton Bi-WKV kernels TREAD_WKV_KERNEL picks (unset or empty: chunked); a bad value is one sentence."""
    value = os.environ.get("TREAD_WKV_KERNEL") or "chunked"
    if value not in WKV_KERNELS:
        hint = f" (names are lower case: {value.lower()})" if value.lower() in WKV_KERNELS else ""
        raise ConfigError(f"TREAD_WKV_KERNEL={value!r} is not a Bi-WKV kernel{hint}; use chunked or fused, or unset "
                          f"it for chunked.")
    return value


def check_wkv_environment(cuda: bool) -> list[str]:
    """Refuses a bad TREAD_WKV_KERNEL in one sentence; a one-line note when it is set where no Triton Bi-WKV runs
    (no CUDA GPU and no TRITON_INTERPRET=1: RWKV runs the chunked PyTorch op)."""
    kernel = wkv_kernel()
    if os.environ.get("TREAD_WKV_KERNEL") and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return [f"note: TREAD_WKV_KERNEL={kernel} does nothing here: it picks the Triton Bi-WKV kernels, and without "
                f"a CUDA GPU Bi-WKV runs the PyTorch op."]
    return []
