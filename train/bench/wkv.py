"""Benchmark of Bi-WKV: the Triton kernels (CUDA; three launches per pass, and one, TREAD_WKV_KERNEL=fused) vs the
chunked O(B T C) op vs the O(T^2) reference.

    python -m train.bench.wkv                                          # CPU: chunked vs reference, B=8
    python -m train.bench.wkv --device cuda --B 64 --repeats 20        # adds the Triton kernels and the roofline
    python -m train.bench.wkv --device cuda --B 64 --dtype bf16        # bf16 k, v (fp32 accumulation)
    python -m train.bench.wkv --counts-only                            # bytes and programs, no timing

First, without timing anything, the bytes the Triton kernels move and the programs they launch at the reference
shape (B64 T256 C384 bf16, issue 36) and at the shape asked for (backbones.ops.wkv_triton.traffic: every launch,
each tensor it reads or writes counted once; wkv_triton_fused.traffic for the one-launch kernels). Then it times
forward and forward+backward of every method on the
same inputs (decays spread over w T in [-5, 3], the Vision-RWKV init range, keys ~ N(0, 1)) and prints the median
of --repeats interleaved runs after warm-up, the speed ratios measured in this one run, the largest difference to
the reference, and beside each Triton time its bytes, programs and, on a card of known bandwidth, the achieved
bandwidth as a fraction of the card's (train.bench.timing.roofline). Those medians are synchronous wall times
(the host's launch path and the kernels, one after the other); on a GPU each also gets its device time (CUDA
events over --repeats back-to-back calls) and the host's time to issue one call, with its share of the wall time
(train.bench.timing.device_times). On a CPU the device time is the wall time, and says so. The O(T^2) reference is timed only while
B T^2 C stays below --reference-limit (its (C, T, T) decay matrices and T^2 work per channel make it the slowest
by far at the reference shape); otherwise one line says it was skipped.
"""

from __future__ import annotations

import argparse
import os

import torch

from backbones.ops.wkv import bi_wkv, bi_wkv_reference
from train.bench.timing import CARD_BANDWIDTH, device_columns, device_times, interleaved_medians, roofline
from train.cli import ArgumentParser, bounded, device as device_type

REFERENCE_SHAPE = (64, 256, 384)


def ideal_bytes(B: int, T: int, C: int, element: int) -> tuple[int, int]:
    """(forward, forward+backward) bytes if every tensor is read or written once; w, u are fp32 (C,)."""
    n = B * T * C
    forward = 3 * n * element + 2 * C * 4  # read k, v, w, u; write y
    return forward, forward + 5 * n * element + 4 * C * 4  # read k, v, dy; write dk, dv; read w, u; write dw, du


def _traffic(B: int, T: int, C: int, element: int, fused: bool = False) -> dict[str, list[tuple[str, int, int]]]:
    from backbones.ops import wkv_triton, wkv_triton_fused  # imports triton

    if fused:
        return wkv_triton_fused.traffic(B, T, C, element, wkv_triton.chunk_len(T))
    return wkv_triton.traffic(B, T, C, element)


def kernel_traffic(B: int, T: int, C: int, element: int, fused: bool = False) -> dict[str, tuple[int, int]]:
    """{"fwd": (bytes, programs), "fwd+bwd": ...} of the Triton kernels, all launches of each pass added up; fused:
    the one-launch kernels."""
    launches = _traffic(B, T, C, element, fused)
    fwd = launches["forward"]
    both = fwd + launches["backward"]
    return {"fwd": (sum(b for _, b, _ in fwd), sum(p for _, _, p in fwd)),
            "fwd+bwd": (sum(b for _, b, _ in both), sum(p for _, _, p in both))}


def print_counts(B: int, T: int, C: int, element: int, dtype: str) -> None:
    """Bytes and programs of every launch at one shape, both kernels, and the ideal (each input and output touched
    once)."""
    for fused, title in ((False, "three launches per pass"), (True, "one launch per pass, TREAD_WKV_KERNEL=fused")):
        print(f"Triton Bi-WKV at B{B} T{T} C{C} {dtype}, {title} (32 channels per program; the autotuner may pick "
              f"more for three):")
        for direction, launches in _traffic(B, T, C, element, fused).items():
            for name, nbytes, programs in launches:
                print(f"  {direction:8s} {name:12s} {roofline(nbytes, programs)}")
        for label, (nbytes, programs) in kernel_traffic(B, T, C, element, fused).items():
            at = ", ".join(f"{nbytes / CARD_BANDWIDTH[card] * 1e3:.3f} ms on an {card}" for card in ("H100", "H200"))
            print(f"  {label:21s} {roofline(nbytes, programs)}; at peak bandwidth {at}")
    fwd_ideal, both_ideal = ideal_bytes(B, T, C, element)
    print(f"  ideal (each tensor once): fwd {fwd_ideal / 1e6:.1f} MB, fwd+bwd {both_ideal / 1e6:.1f} MB")


# Aten ops that launch no kernel on a GPU (views, allocations, metadata).
_NO_KERNEL = {"aten::" + op for op in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "slice",
    "select", "unsqueeze", "squeeze", "chunk", "split", "split_with_sizes", "unbind", "detach", "alias", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resolve_conj", "resolve_neg", "lift_fresh",
    "contiguous", "to", "_to_copy", "flatten", "view_as", "zeros_like", "numpy_T", "result_type", "lift_fresh_copy",
)}


def block_kernel_counts(backend: str | None, dim: int = 64, grid: tuple[int, int] = (8, 8)) -> dict[str, int]:
    """Kernels one RWKV block launches in forward + backward (no optimizer), counted with torch.profiler on the
    CPU: leaf aten ops that compute (views and allocations left out) and Inductor's fused kernels, outside
    Bi-WKV; and the Bi-WKV ops themselves (on a GPU 3 Triton launches forward and 4 backward each).
    backend None is eager; else torch.compile's backend (Inductor's C++ kernels are profiled by name)."""
    import torch._inductor.config as inductor_config

    from backbones.rwkv import Block

    torch.manual_seed(0)
    block = Block(dim, layer_idx=1, depth=4)
    torch.nn.init.normal_(block.adaLN.proj[1].weight, std=0.2)
    x, c = torch.randn(2, grid[0] * grid[1], dim), torch.randn(2, dim)
    grad_out = torch.randn(2, grid[0] * grid[1], dim)  # the block's own work only, no loss
    forward = block if backend is None else torch.compile(block, backend=backend, fullgraph=True)
    # Inductor's kernels carry a profiler name only when generated with this on, so no cached code is reused.
    inductor_config.cpp.enable_kernel_profile = True
    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    for _ in range(2):  # compile and warm up outside the profile
        forward(x, c, grid).backward(grad_out)
    block.zero_grad(set_to_none=True)  # as the trainer: gradients written, not accumulated
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward(x, c, grid).backward(grad_out)
    counts = {"kernels outside Bi-WKV": 0, "Bi-WKV calls": 0}

    def inside_wkv(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("tread_zoo::") or parent.name.startswith("_BiWKV"):
                return True
            parent = parent.cpu_parent
        return False

    for event in prof.events():
        name = event.name
        if name.startswith("tread_zoo::bi_wkv") or name in ("_BiWKV", "_BiWKVBackward"):
            counts["Bi-WKV calls"] += not inside_wkv(event)
            continue
        # An op that computes through another op (clone -> copy_) is counted once, at the innermost one.
        leaf_aten = name.startswith("aten::") and not any(
            ch.name.startswith("aten::") and ch.name not in _NO_KERNEL for ch in event.cpu_children
        )
        fused = "cpp_fused" in name or "triton_" in name  # Inductor's kernels, e.g. graph_0_cpp_fused_silu_0
        if (fused or (leaf_aten and name not in _NO_KERNEL)) and not inside_wkv(event):
            counts["kernels outside Bi-WKV"] += 1
    return counts


def print_block_kernels() -> None:
    """Kernel counts of one RWKV block's training step, eager and compiled (aot_eager: one graph, no fusion;
    inductor: fused)."""
    for backend in (None, "aot_eager", "inductor"):
        counts = block_kernel_counts(backend)
        print(f"RWKV block (D 64, 8x8 tokens) fwd+bwd, {backend or 'eager'}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m train.bench.wkv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=bounded(int, 1, example="--B 8"), default=8)
    parser.add_argument("--T", type=bounded(int, 1, example="--T 256"), default=256)
    parser.add_argument("--C", type=bounded(int, 1, example="--C 384"), default=384)
    parser.add_argument("--repeats", type=bounded(int, 1, example="--repeats 7"), default=7)
    parser.add_argument("--chunk-len", type=bounded(int, 1, example="--chunk-len 32"), default=32)
    parser.add_argument("--threads", type=bounded(int, 1, example="--threads 2"), default=2)
    parser.add_argument("--device", type=device_type, default="cpu", help="cuda adds the Triton kernels")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="dtype of k and v")
    parser.add_argument("--reference-limit", type=bounded(float, 0, example="--reference-limit 3e8"), default=3e8,
                        help="time the O(T^2) reference while B T^2 C <= this")
    parser.add_argument("--counts-only", action="store_true", help="print the bytes and programs, time nothing")
    parser.add_argument("--block-kernels", action="store_true",
                        help="count the kernels of an RWKV block's training step, eager and compiled (CPU profiler)")
    args = parser.parse_args(argv)
    if args.block_kernels:
        print_block_kernels()
        return
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    element = torch.empty(0, dtype=dtype).element_size()
    B, T, C = args.B, args.T, args.C
    print_counts(*REFERENCE_SHAPE, 2, "bf16")
    if (B, T, C, args.dtype) != (*REFERENCE_SHAPE, "bf16"):
        print_counts(B, T, C, element, args.dtype)
    if args.counts_only:
        return

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    # Inputs as one SpatialMix sees them: w and u already divided by T.
    w = (torch.linspace(-5, 3, C, device=device) / T).requires_grad_()
    u = torch.full((C,), -1.2 / T, device=device, requires_grad=True)
    k = torch.randn(B, T, C, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, C, device=device, dtype=dtype, requires_grad=True)
    methods = {"bi_wkv (chunked)": lambda: bi_wkv(w, u, k, v, chunk_len=args.chunk_len, backend="torch")}
    if device.type == "cuda":
        # The switch is read at every call: each method sets it (an environment write, a microsecond, on both).
        def triton(kernel: str):
            def call():
                os.environ["TREAD_WKV_KERNEL"] = kernel
                return bi_wkv(w, u, k, v, backend="triton")
            return call

        methods = {"bi_wkv (Triton)": triton("chunked"), "bi_wkv (Triton, fused)": triton("fused"), **methods}
    if B * T * T * C <= args.reference_limit:
        methods["bi_wkv_reference"] = lambda: bi_wkv_reference(w, u, k.float(), v.float())
    else:
        print(f"bi_wkv_reference: not timed, B T^2 C = {B * T * T * C:.1e} > --reference-limit {args.reference_limit:.0e}")

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"Bi-WKV B={B} T={T} C={C}, {args.dtype}, {where}, torch {torch.__version__}")
    with torch.no_grad():
        # Against the reference where it runs, else against the chunked op.
        base = "bi_wkv_reference" if "bi_wkv_reference" in methods else "bi_wkv (chunked)"
        baseline = methods[base]().float()
        for name in methods:
            if name != base:
                label = "reference" if base == "bi_wkv_reference" else base
                print(f"max |{name} - {label}| = {(methods[name]().float() - baseline).abs().max().item():.1e}")
    calls = {}
    for name, fn in methods.items():
        calls[(name, "fwd")] = lambda fn=fn: torch.no_grad()(fn)()
        calls[(name, "fwd+bwd")] = lambda fn=fn: fn().float().sum().backward()
    ms = {key: s * 1e3 for key, s in interleaved_medians(calls, args.repeats, warmup=3, device=device).items()}
    behind = device_times(calls, args.repeats, device)  # back-to-back, no sync between calls
    for name in methods:
        line = f"{name:18s} fwd {ms[name, 'fwd']:8.3f} ms   fwd+bwd {ms[name, 'fwd+bwd']:8.3f} ms   (median of {args.repeats})"
        print(line)
        for label in ("fwd", "fwd+bwd"):
            print(f"  {label:8s} {device_columns(ms[name, label] / 1e3, behind[name, label])}")
        if name.startswith("bi_wkv (Triton"):
            traffic = kernel_traffic(B, T, C, element, fused="fused" in name)
            for label in ("fwd", "fwd+bwd"):
                print(f"  {label:8s} {roofline(*traffic[label], ms[name, label] / 1e3, device)}")
    fastest = next(iter(methods))
    for name in list(methods)[1:]:
        print(f"speed ratio {name} / {fastest}: fwd x{ms[name, 'fwd'] / ms[fastest, 'fwd']:.1f}, "
              f"fwd+bwd x{ms[name, 'fwd+bwd'] / ms[fastest, 'fwd+bwd']:.1f}")


if __name__ == "__main__":
    main()
