"""The scans' environment switches (TREAD_SCAN_BACKEND, TREAD_SCAN_CHUNK, TREAD_SSD_BACKEND, and Bi-WKV's
TREAD_WKV_KERNEL), checked once when a command starts.

TREAD_SCAN_BACKEND picks the scan's implementation (backbones/ops/cuda_kernels.py) and TREAD_SCAN_CHUNK the Triton
kernels' longest chunk (selective_scan_triton.max_chunk). The scan reads them where it runs: after the model is
built, at its first step, or never (a CPU run never reads the chunk). So without this check a typo fails minutes in
as a traceback, and a value this machine cannot use does nothing without a word. The commands (python -m train,
the scan bench) call `check_scan_environment` first: a bad value is one sentence (ConfigError), a value that does
nothing here is one line they print.
"""

from __future__ import annotations

import os

import torch

from routing.errors import ConfigError


def check_scan_environment(cuda: bool | None = None) -> list[str]:
    """Refuses a bad TREAD_SCAN_BACKEND or TREAD_SCAN_CHUNK in one sentence; returns a one-line note for each set
    value that changes nothing on this machine. cuda: whether the scan runs on a CUDA GPU (default: one is present)."""
    from backbones.ops.cuda_kernels import SCAN_BACKENDS, resolve_backend

    cuda = torch.cuda.is_available() if cuda is None else cuda
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the Triton kernels on CPU tensors (tests)
    backend = os.environ.get("TREAD_SCAN_BACKEND")
    if backend is not None and backend not in SCAN_BACKENDS:
        hint = f" (names are lower case: {backend.lower()})" if backend.lower() in SCAN_BACKENDS else ""
        raise ConfigError(f"TREAD_SCAN_BACKEND={backend!r} is not a selective scan backend{hint}; use one of "
                          f"{', '.join(SCAN_BACKENDS)}, or unset it for auto.")
    needs_gpu = backend not in (None, "", "auto", "torch") and not (backend == "triton" and interpreted)
    if needs_gpu and not cuda:
        raise ConfigError(f"TREAD_SCAN_BACKEND={backend} needs a CUDA GPU and this machine has none; unset it (auto "
                          f"runs the PyTorch scan here) or set it to torch.")
    try:
        path = resolve_backend(backend or "auto", cuda)
    except (RuntimeError, ValueError) as err:  # e.g. mamba_ssm on a GPU machine without mamba-ssm installed
        raise ConfigError(f"TREAD_SCAN_BACKEND={backend}: {str(err).rstrip('.')}; unset it for auto.") from None
    if path == "triton" and not (cuda or interpreted):
        path = "torch"  # what scan_fn runs on CPU tensors

    notes = []
    chunk = os.environ.get("TREAD_SCAN_CHUNK")
    if chunk is not None:
        from backbones.ops.selective_scan_triton import max_chunk

        max_chunk()  # a length the kernels do not take: its one sentence
        if path != "triton":
            why = f"TREAD_SCAN_BACKEND={backend}" if backend else ("no CUDA GPU" if not cuda else "auto picks it here")
            notes.append(f"note: TREAD_SCAN_CHUNK={chunk} does nothing here: it sets the Triton scan's chunk, and this "
                         f"run's selective scan is {path} ({why}).")
    ssd = os.environ.get("TREAD_SSD_BACKEND")
    if ssd is not None:  # Mamba-2's SSD (backbones/ops/ssd_fla.py): its own rules, read here once instead of mid-run
        from backbones.ops.ssd_fla import ssd_backend

        try:
            ssd_backend(cuda)
        except (RuntimeError, ValueError) as err:
            raise ConfigError(f"{str(err).rstrip('.')}; unset TREAD_SSD_BACKEND for auto.") from None
    from backbones.ops.wkv_env import check_wkv_environment  # Bi-WKV's kernel switch (RWKV), read here once too

    return notes + check_wkv_environment(cuda)
