"""Benchmark of Bi-WKV: the fused Triton kernel (CUDA) vs the chunked O(B T C) op vs the O(T^2) reference.

    python -m train.bench.wkv                                          # CPU: chunked vs reference, B=8
    python -m train.bench.wkv --device cuda --B 64 --repeats 20        # adds the Triton kernel and GB/s
    python -m train.bench.wkv --device cuda --B 64 --dtype bf16        # bf16 k, v (fp32 accumulation)

Times forward and forward+backward of every method on the same inputs (decays spread over w T in [-5, 3],
the Vision-RWKV init range, keys ~ N(0, 1)) and prints the median of --repeats interleaved runs after
warm-up, the speed ratios measured in this one run, the largest difference to the reference, and on CUDA
the kernel's achieved bandwidth: ideal bytes (each tensor read or written once) and the bytes it really
moves (it saves y and its denominator in fp32 for the backward), both over its measured time.
"""

from __future__ import annotations

import argparse

import torch

from backbones.ops.wkv import bi_wkv, bi_wkv_reference
from train.bench.timing import interleaved_medians


def ideal_bytes(B: int, T: int, C: int, element: int) -> tuple[int, int]:
    """(forward, forward+backward) bytes if every tensor is read or written once; w, u are fp32 (C,)."""
    n = B * T * C
    forward = 3 * n * element + 2 * C * 4  # read k, v, w, u; write y
    return forward, forward + 5 * n * element + 4 * C * 4  # read k, v, dy; write dk, dv; read w, u; write dw, du


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m train.bench.wkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--C", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunk-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cuda adds the Triton kernel")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="dtype of k and v")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    # Inputs as one SpatialMix sees them: w and u already divided by T.
    B, T, C = args.B, args.T, args.C
    w = (torch.linspace(-5, 3, C, device=device) / T).requires_grad_()
    u = torch.full((C,), -1.2 / T, device=device, requires_grad=True)
    k = torch.randn(B, T, C, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, C, device=device, dtype=dtype, requires_grad=True)
    methods = {
        "bi_wkv (chunked)": lambda: bi_wkv(w, u, k, v, chunk_len=args.chunk_len, backend="torch"),
        "bi_wkv_reference": lambda: bi_wkv_reference(w, u, k.float(), v.float()),
    }
    if device.type == "cuda":
        methods = {"bi_wkv (Triton)": lambda: bi_wkv(w, u, k, v, backend="triton"), **methods}

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"Bi-WKV B={B} T={T} C={C}, {args.dtype}, {where}, torch {torch.__version__}")
    with torch.no_grad():
        reference = methods["bi_wkv_reference"]().float()
        for name, fn in methods.items():
            if name != "bi_wkv_reference":
                print(f"max |{name} - reference| = {(fn().float() - reference).abs().max().item():.1e}")
    calls = {}
    for name, fn in methods.items():
        calls[(name, "fwd")] = lambda fn=fn: torch.no_grad()(fn)()
        calls[(name, "fwd+bwd")] = lambda fn=fn: fn().float().sum().backward()
    ms = {key: s * 1e3 for key, s in interleaved_medians(calls, args.repeats, warmup=3, device=device).items()}
    for name in methods:
        print(f"{name:18s} fwd {ms[name, 'fwd']:8.3f} ms   fwd+bwd {ms[name, 'fwd+bwd']:8.3f} ms   (median of {args.repeats})")
    fastest = next(iter(methods))
    for name in list(methods)[1:]:
        print(f"speed ratio {name} / {fastest}: fwd x{ms[name, 'fwd'] / ms[fastest, 'fwd']:.1f}, "
              f"fwd+bwd x{ms[name, 'fwd+bwd'] / ms[fastest, 'fwd+bwd']:.1f}")
    if device.type == "cuda":
        fwd_bytes, both_bytes = ideal_bytes(B, T, C, k.element_size())
        moved = (7 * B * T * C * 4, 19 * B * T * C * 4)  # what the kernel reads and writes, fwd and fwd+bwd
        for label, ideal, real, key in (("fwd", fwd_bytes, moved[0], "fwd"), ("fwd+bwd", both_bytes, moved[1], "fwd+bwd")):
            seconds = ms[fastest, key] / 1e3
            print(f"Triton {label}: {ideal / seconds / 1e9:.0f} GB/s of ideal bytes, {real / seconds / 1e9:.0f} GB/s moved "
                  f"(compare with the card's peak, e.g. about 3350 GB/s on an H100 SXM)")


if __name__ == "__main__":
    main()
