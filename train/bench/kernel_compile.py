"""Compile every autotune config of the Triton kernels for a GPU target, without a GPU, and print their resources.

    python -m train.bench.kernel_compile                 # sm_90 (H100/H200): every kernel, config, dtype, flag set
    python -m train.bench.kernel_compile --arch 80 --kernels wkv --dtypes bf16
    python -m train.bench.kernel_compile --flags every    # all 16 combinations of D, z, delta_bias, softplus

Each row is one kernel at one autotune config (BLOCK_*, num_warps, num_stages) for one input dtype and one
set of the selective scan's optional flags, compiled ahead of time by Triton (`triton.compile` with a
`GPUTarget`, the ptxas that ships in the triton wheel). Registers and spills come from `ptxas -v` run on the
kernel's PTX with the flags Triton itself passes; shared memory is what Triton asks for at launch. A config that
spills registers to local memory or cannot compile is one an autotuner on a real card would time or crash on,
so the exit status is 1 when any row failed to compile or spilled.

Each kernel is built as Triton's JIT builds it at launch, at the reference shapes (`SCAN_SHAPE`, `WKV_SHAPE`:
the selective scan at b64 d768 L256 N16 with the longest chunk, CHUNK = 256, and the short one, CHUNK = 64, each
with the configs made for it and every channels-per-program CPP its backward may pick; Bi-WKV at B64 T256 C384,
chunks of 16 tokens, combine groups of 16). The JIT specialises its integer arguments by value: a multiple of 16
gets a divisibility-16 hint, which lets loads be vectorised and so changes the layouts, and 1 becomes a
constant; pointers from torch are 16-byte aligned. A build without those hints is not the one that runs, so the
arguments go through the JITFunction's own binder (its `do_not_specialize` list included) and `_pack_args`,
which yield the signature, constants and attributes a launch would compile with (`launch_build`).
Set TRITON_INTERPRET=0 (or leave it unset): under the interpreter the kernels are Python, not compilable.

The last columns read the SASS (`cuobjdump` from the wheel): instructions, exponentials (MUFU.EX2), selects
(FSEL), warp shuffles (SHFL) and barriers (BAR). They show without a GPU whether a walk was unrolled and its
row picks folded (backbones/ops/wkv_triton_walks.py `_PARTS`), and whether a tile's rows stayed in one thread
(no shuffle, no barrier) or were spread over lanes and warps. `s` is the compile time, Triton's cache bypassed
(TRITON_ALWAYS_COMPILE=1): what an autotuner pays per config on first use, on this machine's CPU.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from routing import ConfigError

DTYPES = ("fp32", "bf16")  # input dtypes
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # their torch names (torch is imported where it is used)
# The selective scan's optional inputs: none, the Mamba block's (D, delta_bias, softplus; z is applied outside),
# and all four. `--flags every` takes all 16 combinations.
FLAG_SETS = {
    "none": dict(HAS_D=False, HAS_Z=False, HAS_BIAS=False, SOFTPLUS=False),
    "model": dict(HAS_D=True, HAS_Z=False, HAS_BIAS=True, SOFTPLUS=True),
    "all": dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True),
}
_FLAG_NAMES = {"HAS_D": "D", "HAS_Z": "z", "HAS_BIAS": "bias", "SOFTPLUS": "softplus"}
# Pointers in the compute dtype (fp32); every other pointer has the input's dtype.
_FP32_POINTERS = {"A_ptr", "D_ptr", "bias_ptr", "states_ptr", "dA_ptr", "dB_ptr", "dC_ptr", "dD_ptr", "dbias_ptr",
                  "w_ptr", "u_ptr", "agg_ptr", "carry_ptr", "fcarry_ptr", "bcarry_ptr", "part_ptr"}
_WKV_FP32 = {"u_ptr"}  # WKV's u is the (C,) bonus (fp32); the scan's u is the (b, d, l) input
# The reference shapes the integer arguments take (the scan's n_chunks and slots follow from them, `cases`).
SCAN_SHAPE = dict(batch=64, d=768, g=1, L=256, N=16)
WKV_SHAPE = dict(B=64, T=256, C=384)


@dataclass
class Case:
    kernel: str  # e.g. "scan.fwd"
    fn: object  # the JITFunction
    variant: str  # dtype and flags
    constexprs: dict
    options: dict  # num_warps, num_stages, num_ctas
    dtype: str
    ints: dict  # the integer arguments' values at the reference shape, by name

    @property
    def config(self) -> str:
        tuned = {k: v for k, v in self.constexprs.items() if (k.startswith("BLOCK_") and k not in ("BLOCK_N", "BLOCK_T")) or k == "CPP"}
        return ",".join(f"{k}={v}" for k, v in tuned.items()) + f" w{self.options['num_warps']} s{self.options['num_stages']}"


def _flag_sets(which: str) -> dict[str, dict]:
    if which == "every":
        keys = list(FLAG_SETS["all"])
        sets = {}
        for bits in itertools.product((False, True), repeat=len(keys)):
            flags = dict(zip(keys, bits))
            sets["+".join(_FLAG_NAMES[k] for k in keys if flags[k]) or "none"] = flags
        return sets
    return {name: FLAG_SETS[name] for name in (FLAG_SETS if which == "standard" else which.split(","))}


def _tuned(autotuner, fixed: dict, shape: dict | None = None):
    """(constexprs, options) of each autotune config of `autotuner` that its pruner keeps for these flags and this
    shape (the kernel's integer arguments it reads), with the shape-fixed constexprs added."""
    prune = getattr(autotuner, "early_config_prune", None)
    for config in prune(autotuner.configs, shape or {}, **fixed) if prune else autotuner.configs:
        options = {k: v for k, v in config.all_kwargs().items() if k in ("num_warps", "num_stages", "num_ctas")}
        yield {**fixed, **config.kwargs}, options


def cases(dtypes: list[str], flag_sets: dict[str, dict], kernels: str = "") -> list[Case]:
    """Every (kernel, autotune config, dtype, flags) to compile; `kernels` filters by substring of the name."""
    import torch
    import triton

    from backbones.ops import selective_scan_triton as scan
    from backbones.ops import wkv_triton as wkv

    b, d, g, L = (SCAN_SHAPE[k] for k in ("batch", "d", "g", "L"))
    slots = triton.cdiv(d // g, min(scan.backward_cpps(b, g, d // g)))  # as scan_backward allocates them
    wkv_ints = dict(WKV_SHAPE, n_chunks=triton.cdiv(WKV_SHAPE["T"], wkv.chunk_len(WKV_SHAPE["T"])))
    found = []
    for dtype in dtypes:
        for (name, flags), chunk in itertools.product(flag_sets.items(), (scan.MAX_CHUNK, scan.SHORT_CHUNK)):
            fixed, variant = dict(flags, EXP2=True, BLOCK_N=16, CHUNK=chunk), f"{dtype} {name} L{chunk}"
            ints = dict(SCAN_SHAPE, n_chunks=triton.cdiv(L, chunk), slots=slots)
            for constexprs, options in _tuned(scan.fwd_kernel, dict(fixed, STORE_STATES=True)):
                found.append(Case("scan.fwd", scan.fwd_kernel.fn, variant, constexprs, options, dtype, ints))
            # The pruner reads the batch, groups and channels, and u's dtype (named_args, as the autotuner passes them).
            inputs = dict(SCAN_SHAPE, u_ptr=torch.empty(0, dtype=getattr(torch, TORCH_DTYPES[dtype]), device="meta"))
            for constexprs, options in _tuned(scan.bwd_kernel, fixed, inputs):
                found.append(Case("scan.bwd", scan.bwd_kernel.fn, variant, constexprs, options, dtype, ints))
        for kname, autotuner in (("wkv.fwd_sums", wkv._fwd_sums_kernel), ("wkv.fwd", wkv._fwd_kernel),
                                 ("wkv.bwd_sums", wkv._bwd_sums_kernel), ("wkv.bwd", wkv._bwd_kernel)):
            for constexprs, options in _tuned(autotuner, dict(BLOCK_T=16)):
                found.append(Case(kname, autotuner.fn, dtype, constexprs, options, dtype, wkv_ints))
        if dtype == dtypes[0]:  # the combine walk reads only fp32 scratch, at the one launch config wkv uses
            for fields in (6, 10):
                found.append(Case(f"wkv.combine{fields}", wkv._combine_kernel, "fp32 scratch",
                                  dict(FIELDS=fields, BLOCK_T=16, BLOCK_C=32, GROUP=wkv._GROUP, PARTS=wkv._GROUP_PARTS),
                                  dict(num_warps=1, num_stages=3, num_ctas=1), "fp32", wkv_ints))
    return [c for c in found if kernels in c.kernel]


def launch_build(case: Case, arch: int):
    """(ASTSource, options) of the kernel the JIT compiles when `case` is launched on sm_<arch>: the arguments go
    through the JITFunction's binder (Triton's specialisation rule and the kernel's do_not_specialize list) and
    `_pack_args`, as `JITFunction.run` does. Pointers are empty meta tensors of their dtype (address 0: 16-byte
    aligned, as torch's allocations are)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fp32 = _FP32_POINTERS - (set() if case.kernel.startswith("wkv") else _WKV_FP32)
    kwargs = dict(case.constexprs, **case.options)
    for arg in case.fn.arg_names:
        if arg.endswith("_ptr"):
            dtype = torch.float32 if arg in fp32 else getattr(torch, TORCH_DTYPES[case.dtype])
            kwargs[arg] = torch.empty(0, dtype=dtype, device="meta")
        elif arg not in case.constexprs:
            kwargs[arg] = case.ints[arg]
    backend = make_backend(GPUTarget("cuda", arch, 32))
    bound, specialization, options = create_function_from_signature(case.fn.signature, case.fn.params, backend)(**kwargs)
    options, signature, constexprs, attrs = case.fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compiler.ASTSource(fn=case.fn, signature=signature, constexprs=constexprs, attrs=attrs), options


@dataclass
class Row:
    case: Case
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    shared: int = -1
    seconds: float = 0.0
    error: str = ""
    sass: dict = None  # instruction counts: all, MUFU.EX2, FSEL, SHFL, BAR


def compile_case(case: Case, arch: int) -> Row:
    """Compiles one case for sm_<arch> and reads its registers and spills from `ptxas -v`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    start = time.perf_counter()
    try:
        src, options = launch_build(case, arch)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options.__dict__)
        compiled_s = time.perf_counter() - start
    except Exception as err:  # a compile failure is a result of this tool: report it in the table
        return Row(case, seconds=time.perf_counter() - start, error=f"{type(err).__name__}: {str(err).strip()[:300]}")
    # Triton does not keep ptxas's log; running ptxas again on the PTX with Triton's flags takes ~0.1 s.
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", ptx, "-o", ptx + ".o"],
                             capture_output=True, text=True, check=True).stderr
        sass = _sass_counts(get_ptxas(arch).path, kernel.asm["cubin"], tmp)
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return Row(case, registers=int(regs.group(1)), spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
               shared=kernel.metadata.shared, seconds=compiled_s, sass=sass)


def _sass_counts(ptxas: str, cubin: bytes, tmp: str) -> dict:
    """Instructions, exponentials, selects, shuffles and barriers in the kernel's SASS, by the cuobjdump beside the
    wheel's ptxas."""
    path = os.path.join(tmp, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    listing = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", path], capture_output=True,
                             text=True, check=True).stdout
    # "/*0040*/  @!P0 SHFL.BFLY PT, R2, R0, 0x10, 0x1f ;": the opcode follows the offset and an optional predicate.
    ops = [m.group(1) for line in listing.splitlines()
           if (m := re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)", line))]
    return {"all": len(ops), "exp": ops.count("MUFU.EX2"), "sel": sum(op.startswith("FSEL") for op in ops),
            "shfl": sum(op.startswith("SHFL") for op in ops), "bar": sum(op.split(".")[0] == "BAR" for op in ops)}


def table(rows: list[Row]) -> str:
    head = (f"{'kernel':<14} {'variant':<26} {'config':<18} {'regs':>5} {'spill st/ld (B)':>16} {'shared (B)':>11} {'s':>5} "
            f"{'SASS':>6} {'exp':>5} {'sel':>5} {'shfl':>5} {'bar':>4}")
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r.case
        if r.error:
            lines.append(f"{c.kernel:<14} {c.variant:<26} {c.config:<18} FAILED: {r.error}")
        else:
            spill = f"{r.spill_stores}/{r.spill_loads}"
            lines.append(f"{c.kernel:<14} {c.variant:<26} {c.config:<18} {r.registers:>5} {spill:>16} {r.shared:>11} "
                         f"{r.seconds:>5.1f} {r.sass['all']:>6} {r.sass['exp']:>5} {r.sass['sel']:>5} "
                         f"{r.sass['shfl']:>5} {r.sass['bar']:>4}")
    return "\n".join(lines)


def check_environment() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise ConfigError("TRITON_INTERPRET is set, so the kernels are interpreted Python and cannot be compiled; "
                          "run with TRITON_INTERPRET=0 (or unset it)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench.kernel_compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability without the dot: 90 = H100/H200")
    parser.add_argument("--kernels", default="", help="only kernels whose name contains this, e.g. scan.fwd or wkv")
    parser.add_argument("--dtypes", default="fp32,bf16", help="input dtypes, comma-separated: fp32, bf16")
    parser.add_argument("--flags", default="standard",
                        help="scan flag sets: standard (none, model, all), every (all 16), or names from none,model,all")
    args = parser.parse_args(argv)
    check_environment()
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # the seconds column is a compile, never a cache hit
    dtypes = args.dtypes.split(",")
    if bad := [d for d in dtypes if d not in DTYPES]:
        raise ConfigError(f"--dtypes: {bad[0]!r} is not one of {', '.join(DTYPES)}; pass e.g. --dtypes fp32,bf16")
    if args.flags not in ("standard", "every") and (bad := [f for f in args.flags.split(",") if f not in FLAG_SETS]):
        raise ConfigError(f"--flags: {bad[0]!r} is not standard, every or one of {', '.join(FLAG_SETS)}")
    todo = cases(dtypes, _flag_sets(args.flags), args.kernels)
    if not todo:
        raise ConfigError(f"--kernels: no kernel name contains {args.kernels!r}; try scan, wkv, scan.bwd or wkv.combine")
    print(f"compiling {len(todo)} kernel configs for sm_{args.arch} as launched at the reference shapes "
          "(Triton AOT, no GPU needed)", flush=True)
    rows = []
    for case in todo:
        rows.append(compile_case(case, args.arch))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    bad = [r for r in rows if r.error or r.spill_stores > 0]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} compiled without spills for sm_{args.arch}; {len(bad)} failed or spilled")
    return 1 if bad else 0


if __name__ == "__main__":
    from train.cli import friendly_errors

    sys.exit(friendly_errors(main)())
