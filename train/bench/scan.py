"""Benchmark of the selective scan on the CPU: our scan vs the sequential reference vs mambapy.

    python -m train.bench.scan                      # B=8, L=256, D=768, N=16, 2 threads
    python -m train.bench.scan --device cuda        # adds our Triton kernel, and mamba-ssm's when installed
    python -m train.bench.scan --device cuda --batch 64 --dim 768 --dtype bf16 --ref-repeats 0   # the issue's shape

Times forward and forward+backward of the same computation, y = selective_scan(u, delta, A, B, C, D) with
delta = softplus(delta + delta_bias), and prints the ratios measured in this one run. mambapy (a pure-PyTorch
Mamba with a Blelloch parallel scan, `pip install mambapy`) is timed through its own
`MambaBlock.selective_scan`; its inputs are transposed to its (B, L, D) layout outside the timed region.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from backbones.ops.cuda_kernels import cuda_selective_scan, triton_selective_scan
from backbones.ops.selective_scan import num_chunks, selective_scan, selective_scan_ref


def _once(fn: Callable[[], torch.Tensor], backward: bool, device: torch.device) -> float:
    """Seconds for one call (and its backward)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    if backward:
        y = fn()
        y.backward(torch.ones_like(y))
    else:
        with torch.no_grad():
            fn()
    sync()
    return time.perf_counter() - start


def _mambapy_scan() -> Callable | None:
    """mambapy's selective scan (pscan version) as a function of its (B, L, D) tensors, or None if missing."""
    try:
        from mambapy.mamba import MambaBlock
    except ImportError:
        return None
    # The method reads nothing from self; calling it unbound runs mambapy's own code unchanged.
    return lambda x, delta, A, B, C, D: MambaBlock.selective_scan(None, x, delta, A, B, C, D)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m train.bench.scan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--state", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the minimum is reported")
    parser.add_argument("--ref-repeats", type=int, default=2, help="rounds with the slow reference (0 skips it)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cuda adds our Triton kernel, and mamba-ssm's when it is installed")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="dtype of u, delta, B, C (state and sums stay fp32)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)

    # Inputs in mamba-ssm's layout, sized like one direction of a Mamba mixer.
    b, d, l, n = args.batch, args.dim, args.length, args.state
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    u = torch.randn(b, d, l, device=device, dtype=dtype, requires_grad=True)
    delta = torch.randn(b, d, l, device=device, dtype=dtype, requires_grad=True)
    delta_bias = torch.full((d,), -4.0, device=device, requires_grad=True)  # softplus(-4) ~ 0.018, a typical dt
    A = (-torch.arange(1, n + 1.0, device=device).repeat(d, 1)).requires_grad_()  # (d, n), Mamba's S4D-real init
    B = torch.randn(b, n, l, device=device, dtype=dtype, requires_grad=True)
    C = torch.randn(b, n, l, device=device, dtype=dtype, requires_grad=True)
    D = torch.ones(d, device=device, requires_grad=True)
    ours = lambda: selective_scan(u, delta, A, B, C, D, delta_bias=delta_bias, delta_softplus=True)  # noqa: E731
    ref = lambda: selective_scan_ref(u, delta, A, B, C, D, delta_bias=delta_bias, delta_softplus=True)  # noqa: E731

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"selective scan, B={b} L={l} D={d} N={n}, {args.dtype}, {where}, torch {torch.__version__}")
    chunks = num_chunks(l, b * d * n, device.type == "cuda")
    path = f"chunked ({chunks} chunks)" if device.type == "cuda" or chunks > 1 else "streaming"
    print(f"ours takes the {path} path")
    rows = {"ours": (ours, args.repeats)}
    if args.ref_repeats > 0:
        rows["sequential reference"] = (ref, args.ref_repeats)
    kernel = cuda_selective_scan() if device.type == "cuda" else None
    if kernel is not None:
        rows["mamba-ssm CUDA"] = (lambda: kernel(u, delta, A, B, C, D, None, delta_bias, True), args.repeats)
    triton_scan = triton_selective_scan() if device.type == "cuda" else None
    if triton_scan is not None:
        rows["Triton"] = (lambda: triton_scan(u, delta, A, B, C, D, None, delta_bias, True), args.repeats)
        with torch.no_grad():
            diff = (rows["Triton"][0]().float() - ours().float()).abs().max().item()
        print(f"Triton matches ours to max |diff| = {diff:.1e}")
    pscan_scan = _mambapy_scan()
    if pscan_scan is None:
        print("mambapy is not installed (pip install mambapy); its column is skipped.")
    else:
        # mambapy's layout: (B, L, D) activations, (B, L, N) B and C; transposed outside the timed region.
        # (B, X, L) -> (B, L, X)
        u_m, delta_m, B_m, C_m = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (u, delta, B, C))
        A_m, D_m, bias_m = (t.detach().clone().requires_grad_() for t in (A, D, delta_bias))

        def mambapy() -> torch.Tensor:
            return pscan_scan(u_m, F.softplus(delta_m + bias_m), A_m, B_m, C_m, D_m)

        with torch.no_grad():
            diff = (mambapy().transpose(1, 2) - ours()).abs().max().item()  # (B, L, D) -> (B, D, L)
        print(f"mambapy {importlib.metadata.version('mambapy')} matches ours to max |diff| = {diff:.1e}")
        rows["mambapy pscan"] = (mambapy, args.repeats)

    # Rounds interleave the methods, and the minimum over rounds is reported, so that load from other
    # processes on a shared CPU hits every method alike and is mostly filtered out.
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    for fn, repeats in rows.values():
        if repeats > 1:  # the slow reference, timed once or twice, is not worth a warm-up
            # Both variants: a kernel's no-grad forward may be compiled separately (Triton stores no states there).
            _once(fn, False, device)
            _once(fn, True, device)
    for round_idx in range(args.repeats):
        for name, (fn, repeats) in rows.items():
            if round_idx < repeats:
                times[name].append((_once(fn, False, device), _once(fn, True, device)))
    best = {name: (min(t[0] for t in ts), min(t[1] for t in ts)) for name, ts in times.items()}
    for name, (fwd, both) in best.items():
        print(f"{name:22s} fwd {fwd * 1e3:8.1f} ms   fwd+bwd {both * 1e3:8.1f} ms   (min of {len(times[name])})")
    base_fwd, base_both = best["ours"]
    for name, (fwd, both) in best.items():
        if name != "ours":
            print(f"{name} / ours: fwd x{fwd / base_fwd:.2f}, fwd+bwd x{both / base_both:.2f}")


if __name__ == "__main__":
    main()
