"""Benchmark of Bi-WKV on the CPU: the chunked O(B T C) op vs the O(T^2) decay-matrix reference.

    python -m train.bench_wkv                       # B=8, T=256, C=384, 2 threads

Times forward and forward+backward of both on the same inputs (decays spread over w T in [-5, 3], the
Vision-RWKV init range, keys ~ N(0, 1)) and prints the median of --repeats runs after one warm-up, the
speed ratio measured in this one run, and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from backbones.ops.wkv import bi_wkv, bi_wkv_reference


def _median_ms(fn: Callable[[], torch.Tensor], repeats: int, backward: bool) -> float:
    """Median milliseconds per call over `repeats` calls after one warm-up call."""

    def step() -> None:
        y = fn()
        if backward:
            y.sum().backward()

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--C", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunk-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    # Inputs as one SpatialMix sees them: w and u already divided by T.
    B, T, C = args.B, args.T, args.C
    w = (torch.linspace(-5, 3, C) / T).requires_grad_()
    u = torch.full((C,), -1.2 / T, requires_grad=True)
    k = torch.randn(B, T, C, requires_grad=True)
    v = torch.randn(B, T, C, requires_grad=True)
    fast = lambda: bi_wkv(w, u, k, v, chunk_len=args.chunk_len)  # noqa: E731
    ref = lambda: bi_wkv_reference(w, u, k, v)  # noqa: E731

    with torch.no_grad():
        diff = (fast() - ref()).abs().max().item()
    print(f"Bi-WKV B={B} T={T} C={C}, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"max |fast - reference| = {diff:.1e}")
    times = {}
    for name, fn in (("bi_wkv (chunked)", fast), ("bi_wkv_reference", ref)):
        with torch.no_grad():
            fwd = _median_ms(fn, args.repeats, backward=False)
        times[name] = (fwd, _median_ms(fn, args.repeats, backward=True))
        print(f"{name:18s} fwd {fwd:8.2f} ms   fwd+bwd {times[name][1]:8.2f} ms   (median of {args.repeats})")
    (fast_fwd, fast_both), (ref_fwd, ref_both) = times.values()
    print(f"speed ratio reference / chunked: fwd x{ref_fwd / fast_fwd:.1f}, fwd+bwd x{ref_both / fast_both:.1f}")


if __name__ == "__main__":
    main()
