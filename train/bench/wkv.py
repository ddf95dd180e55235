"""Benchmark of Bi-WKV on the CPU: the chunked O(B T C) op vs the O(T^2) decay-matrix reference.

    python -m train.bench.wkv                       # B=8, T=256, C=384, 2 threads

Times forward and forward+backward of both on the same inputs (decays spread over w T in [-5, 3], the
Vision-RWKV init range, keys ~ N(0, 1)) and prints the median of --repeats interleaved runs after one warm-up, the
speed ratio measured in this one run, and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse

import torch

from backbones.ops.wkv import bi_wkv, bi_wkv_reference
from train.bench.timing import interleaved_medians


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m train.bench.wkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    fast_name, ref_name = "bi_wkv (chunked)", "bi_wkv_reference"
    calls = {}
    for name, fn in ((fast_name, fast), (ref_name, ref)):
        calls[(name, "fwd")] = lambda fn=fn: torch.no_grad()(fn)()
        calls[(name, "fwd+bwd")] = lambda fn=fn: fn().sum().backward()
    ms = {key: s * 1e3 for key, s in interleaved_medians(calls, args.repeats, warmup=1).items()}
    for name in (fast_name, ref_name):
        print(f"{name:18s} fwd {ms[name, 'fwd']:8.2f} ms   fwd+bwd {ms[name, 'fwd+bwd']:8.2f} ms   (median of {args.repeats})")
    print(f"speed ratio reference / chunked: fwd x{ms[ref_name, 'fwd'] / ms[fast_name, 'fwd']:.1f}, "
          f"fwd+bwd x{ms[ref_name, 'fwd+bwd'] / ms[fast_name, 'fwd+bwd']:.1f}")


if __name__ == "__main__":
    main()
