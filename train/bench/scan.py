"""Benchmark of the selective scan on the CPU: our scan vs the sequential reference vs mambapy.

    python -m train.bench.scan                      # B=8, L=256, D=768, N=16, 2 threads
    python -m train.bench.scan --device cuda        # adds our Triton kernel, and mamba-ssm's when installed
    python -m train.bench.scan --device cuda --batch 64 --dim 768 --dtype bf16   # the issue's shape
    python -m train.bench.scan --count-kernels      # kernels of one Mamba block's training step, eager vs compiled

Times forward and forward+backward of the same computation, y = selective_scan(u, delta, A, B, C, D) with
delta = softplus(delta + delta_bias), and prints the ratios measured in this one run. Beside the Triton
kernel's times it prints the bytes the kernels move and the programs they launch (counted from the kernel's
layout, train.bench.timing.roofline) and, on a card of known bandwidth, the fraction of it achieved; the
same counts for the reference shape b64 d768 L256 N16 are printed without running it, so a CPU shows them.
The times above are synchronous wall times (the host's launch path and the kernels, one after the other); on a
GPU each method also gets its device time (CUDA events over --repeats back-to-back calls) and the host's time to
issue one call with its share of the wall time (train.bench.timing.device_times); on a CPU the device time is the
wall time, and says so. The sequential reference is timed only where it is cheap (a line says when it is skipped). mambapy (a pure-PyTorch
Mamba with a Blelloch parallel scan, `pip install mambapy`) is timed through its own
`MambaBlock.selective_scan`; its inputs are transposed to its (B, L, D) layout outside the timed region.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from backbones.ops.cuda_kernels import cuda_selective_scan, scan_fn, triton_selective_scan
from backbones.ops.selective_scan import num_chunks, selective_scan, selective_scan_ref
from train.bench.timing import device_columns, device_times, roofline
from train.cli import ArgumentParser, bounded, check_scan_switches, device as device_type

REFERENCE = dict(b=64, d=768, length=256, n=16)  # the shape: one direction of a Mamba-S/B mixer at batch 64
# Largest b * d * l * n at which the sequential reference (autograd through one step at a time) is timed.
_REF_ELEMENTS = {"cpu": 1 << 25, "cuda": 1 << 28}


def triton_traffic(b: int, d: int, length: int, n: int, itemsize: int, block_d: int, groups: int = 1,
                   has_z: bool = False, store: bool = True, cpp: int | None = None) -> dict[str, tuple[int, int]]:
    """(bytes, programs) of the Triton scan's forward and backward, each tensor counted once (DRAM traffic when
    the re-reads of B, C and delta_{t+1} hit the cache). D and delta_bias are present (d-sized, counted).

    Forward reads u, delta (z) and B, C, writes out and, with `store`, the states entering chunks 2.. .
    Backward reads u, delta, dout (z), B, C, states; writes du, ddelta (dz), the dB / dC partials (one (n, l)
    row pair per program) and per-batch dA, dD, dbias, which torch then sums (read once, write the result).
    `cpp`: backward's channels per program, tuned; by default the smallest it may pick (the most partial rows).
    """
    from backbones.ops.selective_scan_triton import backward_cpps, states_shape, time_chunk

    act, bc = b * d * length * itemsize, b * groups * n * length * itemsize  # one (b, d, l) / (b, g, n, l) tensor
    states = 4 * b * d * n * (states_shape(b, d, length, n)[2]) if store else 0
    params = 4 * (d * n + 2 * d)  # A, D, delta_bias
    k = d // groups
    fwd = (act * (3 + has_z) + 2 * bc + states + params, b * groups * -(-k // block_d))
    time_chunk(length)  # (the chunk fixes the states' layout above)
    parts = -(-k // (cpp or min(backward_cpps(b, groups, k))))
    partials = 2 * 4 * b * groups * parts * n * length
    per_batch = 4 * b * (d * n + 2 * d)
    bwd_bytes = act * (5 + 2 * has_z) + 2 * bc + states + params + partials + per_batch  # the kernel
    bwd_bytes += partials + 2 * bc + per_batch + params  # torch's sums over partials and the batch
    return {"forward": fwd, "backward": (bwd_bytes, b * groups * parts)}


def _tuned(kernel, name: str = "BLOCK_D") -> int:
    """A parameter of the config the autotuner chose on its last run (the first config if it has not run)."""
    config = getattr(kernel, "best_config", None) or kernel.configs[0]
    return config.kwargs[name]


def print_reference_counts(device: torch.device) -> None:
    """The Triton kernel's bytes and programs at the reference shape, fp32 and bf16, without running it."""
    from backbones.ops.selective_scan_triton import FWD_CONFIGS, backward_cpps

    r = REFERENCE
    block_ds = sorted({bd for bd, _ in FWD_CONFIGS})  # the configs for 256-step chunks, the reference's
    cpps = backward_cpps(r["b"], 1, r["d"])
    for dtype, itemsize in (("fp32", 4), ("bf16", 2)):
        t = {bd: triton_traffic(r["b"], r["d"], r["length"], r["n"], itemsize, bd) for bd in block_ds}
        fwd, bwd = t[block_ds[0]]["forward"], t[block_ds[0]]["backward"]
        widest = triton_traffic(r["b"], r["d"], r["length"], r["n"], itemsize, block_ds[0], cpp=cpps[-1])["backward"]
        programs = "-".join(f"{t[bd]['forward'][1]:,}" for bd in (block_ds[-1], block_ds[0]))
        print(f"  reference b{r['b']} d{r['d']} L{r['length']} N{r['n']} {dtype}: forward {fwd[0] / 1e6:.1f} MB in "
              f"{programs} programs (BLOCK_D {block_ds[-1]}..{block_ds[0]}, tuned); backward {roofline(*bwd, device=device)} "
              f"at CPP {cpps[0]}, {roofline(*widest, device=device)} at CPP {cpps[-1]} (tuned); "
              f"fwd+bwd {roofline(fwd[0] + bwd[0], fwd[1] + bwd[1], device=device)} (BLOCK_D {block_ds[0]}, CPP {cpps[0]})")


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


def _launches(name: str) -> bool:
    """Whether the op `name` (a profiler event) launches a kernel: not a view, not a bare allocation."""
    if "cpp_fused" in name or name.startswith("triton_"):  # a kernel Inductor generated (graph_0_cpp_fused_...)
        return True
    namespace, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), op, None) if namespace in ("aten", "tread") else None
    if packet is None or op in ("empty", "empty_like", "empty_strided", "new_empty", "detach", "lift_fresh", "reshape"):
        return False
    return not any(getattr(packet, overload).is_view for overload in packet.overloads())


def _count_kernels(step: Callable[[], None]) -> collections.Counter:
    """Kernels one call of `step` launches, from the profiler: ops not inside another op (an op's own calls are
    its implementation; a custom op counts once) that launch a kernel, and Inductor's generated kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: collections.Counter = collections.Counter()
    for event in prof.events():
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested = "::" in parent.name and parent.name.split("::")[0] in ("aten", "tread")
            parent = parent.cpu_parent
        if not nested and _launches(event.name):
            counts[event.name] += 1
    return counts


def print_block_kernel_counts(device: torch.device) -> None:
    """Kernels of one Mamba block's forward + backward (tiny: width 64, 16 tokens), eager and compiled.

    The scan is its custom op in both (1 node forward, 1 backward; on a GPU these are the Triton kernels, plus
    5 small sums in backward). Compiled: Inductor, fullgraph, its generated kernels plus the library calls.
    """
    import backbones.mamba as mamba
    from backbones.ops.selective_scan_op import selective_scan_compilable

    torch.manual_seed(0)
    block = mamba.Block(hidden_size=64, layer_idx=0, depth=1).to(device)
    x, c = torch.randn(2, 16, 64, device=device), torch.randn(2, 64, device=device)

    def step(module) -> Callable[[], None]:
        def run() -> None:
            block.zero_grad(set_to_none=True)  # the first backward writes .grad; no accumulation kernels
            module(x, c, (4, 4)).square().mean().backward()

        return run

    def summary(counts: collections.Counter) -> str:
        grouped = collections.Counter()
        for name, count in counts.items():
            grouped["generated by Inductor" if "cpp_fused" in name or name.startswith("triton_") else name] += count
        return f"{sum(counts.values())} kernels ({', '.join(f'{k} {v}' for k, v in grouped.most_common(9))}, ...)"

    eager_scan, mamba.scan_fn = mamba.scan_fn, selective_scan_compilable  # the op in eager too: counted as one
    try:
        step(block)()  # warm-up
        eager = _count_kernels(step(block))
    finally:
        mamba.scan_fn = eager_scan
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):  # Inductor's kernels show in the profiler
        compiled_block = torch.compile(block, fullgraph=True)
        step(compiled_block)()  # compiles forward and backward
        compiled = _count_kernels(step(compiled_block))
    print(f"Mamba block (width 64, 16 tokens, {device}), one forward + backward:")
    print(f"  eager: {summary(eager)}")
    print(f"  compiled: {summary(compiled)}")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m train.bench.scan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=bounded(int, 1, example="--batch 8"), default=8)
    parser.add_argument("--length", type=bounded(int, 1, example="--length 256"), default=256)
    parser.add_argument("--dim", type=bounded(int, 1, example="--dim 768"), default=768)
    parser.add_argument("--state", type=bounded(int, 1, example="--state 16"), default=16)
    parser.add_argument("--repeats", type=bounded(int, 1, example="--repeats 5"), default=5, help="interleaved rounds; the minimum is reported")
    parser.add_argument("--ref-repeats", type=bounded(int, 0, example="--ref-repeats 2"), default=2, help="rounds with the slow reference (0 skips it)")
    parser.add_argument("--threads", type=bounded(int, 1, example="--threads 2"), default=2)
    parser.add_argument("--device", type=device_type, default="cpu", help="cuda adds our Triton kernel, and mamba-ssm's when it is installed")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="dtype of u, delta, B, C (state and sums stay fp32)")
    parser.add_argument("--cuda-kernel", action="store_true", help="with --device cuda, add our CUDA scan (TREAD_SCAN_BACKEND=cuda; "
                        "load_inline compiles it on the first call, minutes)")
    parser.add_argument("--count-kernels", action="store_true", help="count the kernels of one Mamba block's training "
                        "step, eager and compiled, instead of timing the scan")
    args = parser.parse_args(argv)
    if args.cuda_kernel and args.device != "cuda":
        parser.error("--cuda-kernel times a CUDA kernel: add --device cuda on a machine with a GPU")
    check_scan_switches(parser, torch.device(args.device).type == "cuda")
    if args.count_kernels:
        print_block_kernel_counts(torch.device(args.device))
        return
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
    print("Triton kernel, counted from its layout (not run):")
    print_reference_counts(device)
    rows = {"ours": (ours, args.repeats)}
    if args.ref_repeats > 0 and b * d * l * n > _REF_ELEMENTS.get(device.type, 0):
        print(f"sequential reference skipped: b*d*L*N = {b * d * l * n:,} is above {_REF_ELEMENTS.get(device.type, 0):,} "
              f"on {device.type}, where one step at a time takes seconds (--ref-repeats 0 silences this)")
    elif args.ref_repeats > 0:
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
    if args.cuda_kernel:
        rows["ours, CUDA"] = (lambda: scan_fn(u, delta, A, B, C, D, None, delta_bias, True, backend="cuda"), args.repeats)
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
    # Back-to-back calls without a sync between them (not the slow reference): device and host time per call.
    calls = {}
    for name, (fn, _) in rows.items():
        if name != "sequential reference":
            calls[name, "fwd"] = lambda fn=fn: torch.no_grad()(fn)()
            calls[name, "fwd+bwd"] = lambda fn=fn: fn().sum().backward()
    behind = device_times(calls, args.repeats, device)
    for name, (fwd, both) in best.items():
        print(f"{name:22s} fwd {fwd * 1e3:9.3f} ms   fwd+bwd {both * 1e3:9.3f} ms   (min of {len(times[name])})")
        for label, wall in (("fwd", fwd), ("fwd+bwd", both)):
            if (name, label) in behind:
                print(f"{'':22s} {label:8s} {device_columns(wall, behind[name, label])}")
        if name == "Triton":
            from backbones.ops.selective_scan_triton import bwd_kernel, fwd_kernel

            t = triton_traffic(b, d, l, n, u.element_size(), _tuned(fwd_kernel), store=False)
            t_train = triton_traffic(b, d, l, n, u.element_size(), _tuned(fwd_kernel), cpp=_tuned(bwd_kernel, "CPP"))
            total = (t_train["forward"][0] + t_train["backward"][0], t_train["forward"][1] + t_train["backward"][1])
            print(f"{'':22s} fwd: {roofline(*t['forward'], fwd, device)}")
            print(f"{'':22s} fwd+bwd: {roofline(*total, both, device)}")
    base_fwd, base_both = best["ours"]
    for name, (fwd, both) in best.items():
        if name != "ours":
            print(f"{name} / ours: fwd x{fwd / base_fwd:.2f}, fwd+bwd x{both / base_both:.2f}")


if __name__ == "__main__":
    from train.cli import friendly_errors

    friendly_errors(main)()
