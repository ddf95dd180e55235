"""Compile every autotune config of the Triton kernels for a GPU target, without a GPU, and print their resources.

    python -m train.bench.kernel_compile                 # sm_90 (H100/H200): every kernel, config, dtype, flag set
    python -m train.bench.kernel_compile --arch 80 --kernels wkv --dtypes bf16
    python -m train.bench.kernel_compile --flags every    # all 16 combinations of D, z, delta_bias, softplus
    python -m train.bench.kernel_compile --kernels scan --lengths 256,1024,4096,16384   # the scaling bench's lengths
    python -m train.bench.kernel_compile --kernels scan --unspecialised                 # every integer plain

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
which yield the signature, constants and attributes a launch would compile with (`launch_build`). A config's
register budget (`maxnreg`, shown as r<N>) goes into the build as the launch passes it. `--lengths` builds the
scan's kernels at other sequence lengths, the batch keeping SCAN_TOKENS (variants "@length x batch");
`--unspecialised` builds every integer argument without hints, for comparison only (not what runs).
Set TRITON_INTERPRET=0 (or leave it unset): under the interpreter the kernels are Python, not compilable.

The last columns read the SASS (`cuobjdump` from the wheel): instructions, exponentials (MUFU.EX2), selects
(FSEL), warp shuffles (SHFL) and barriers (BAR). They show without a GPU whether a walk was unrolled and its
row picks folded (backbones/ops/wkv_triton_walks.py `_PARTS`), and whether a tile's rows stayed in one thread
(no shuffle, no barrier) or were spread over lanes and warps. `s` is the compile time, Triton's cache bypassed
(TRITON_ALWAYS_COMPILE=1): what an autotuner pays per config on first use, on this machine's CPU. `occ` is the
warps one SM holds at once (`occupancy`: registers, shared memory, the block limits of sm_90), the warps left to hide
each other's latency. For the scan, `upd` is the warp instructions per state update that the launch executes (each SASS
instruction weighted by the trip counts of the loops around it, `_executed`). `est ms` is the launch's device time on
an H100 at the rate of its busiest pipe (`PIPES`: instruction issue, the special-function unit, the shuffle unit),
`bound` that pipe: a floor without stalls, an estimate, not a measurement; "-" where the build keeps a loop whose trip
count the tool does not know.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

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
                  "w_ptr", "u_ptr", "agg_ptr", "carry_ptr", "fcarry_ptr", "bcarry_ptr", "part_ptr",
                  "hand_ptr"}
_WKV_FP32 = {"u_ptr"}  # WKV's u is the (C,) bonus (fp32); the scan's u is the (b, d, l) input
# The reference shapes the integer arguments take (the scan's n_chunks and slots follow from them, `cases`).
SCAN_SHAPE = dict(batch=64, d=768, g=1, L=256, N=16)
# `--lengths`: the scaling bench's sequence lengths (train.bench.scaling), each at the batch that keeps SCAN_TOKENS.
SCAN_TOKENS = SCAN_SHAPE["batch"] * SCAN_SHAPE["L"]
# The device-time estimate on an H100 SXM (132 SMs at 1.755 GHz). Per SM and cycle: 4 warp instructions issued (one
# per scheduler, the rate issue 46 used: the selective scan backward's 4.8 per state update = 1.04 ms), half a warp's
# MUFU (exp2, rcp, ...: 16 lanes a cycle) and one warp shuffle (32 lanes a cycle), the CUDA C++ Programming Guide's
# throughputs for compute capability 9.0. The launch takes at least what its busiest pipe needs: a floor before any
# stall, latency or barrier wait, an estimate, not a measurement.
H100_SMS, H100_CLOCK_HZ = 132, 1.755e9
PIPES = {"issue": 4.0, "mufu": 0.5, "shfl": 1.0}  # warp instructions per SM per cycle
_PIPE_OPS = {"issue": ("",), "mufu": ("MUFU",), "shfl": ("SHFL",)}  # SASS opcode prefixes each pipe executes
# sm_90's limits per SM (CUDA C++ Programming Guide, "Technical Specifications"): registers are allocated per warp in
# units of 256; 228 KB of shared memory, of which the runtime reserves 1 KB per block.
SM90_REGISTERS, SM90_REG_UNIT, SM90_SHARED, SM90_BLOCK_RESERVED = 65536, 256, 228 * 1024, 1024
SM90_MAX_WARPS, SM90_MAX_BLOCKS = 64, 32
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
    # The kernel's loops, innermost first, as (integer argument or None for a constexpr, trip count); empty: none (a
    # build with a loop then has no estimate). A loop over an argument the launch build takes as the constant 1 is gone
    # (`loops`).
    trips: tuple = ()
    programs: int = 0  # the launch grid's programs
    updates: int = 0  # the scan's state updates of the whole launch (b d l n), for the per-update rate; 0: not a scan

    @property
    def config(self) -> str:
        tuned = {k: v for k, v in self.constexprs.items() if (k.startswith("BLOCK_") and k not in ("BLOCK_N", "BLOCK_T")) or k in ("CPP", "CHUNKS")}
        budget = f" r{self.options['maxnreg']}" if self.options.get("maxnreg") else ""
        return (",".join(f"{k}={v}" for k, v in tuned.items()) + f" w{self.options['num_warps']} s{self.options['num_stages']}"
                + budget)


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
        options = {k: v for k, v in config.all_kwargs().items()
                   if k in ("num_warps", "num_stages", "num_ctas") or (k == "maxnreg" and v is not None)}
        yield {**fixed, **config.kwargs}, options


def cases(dtypes: list[str], flag_sets: dict[str, dict], kernels: str = "", lengths: tuple[int, ...] = (256,)) -> list[Case]:
    """Every (kernel, autotune config, dtype, flags) to compile; `kernels` filters by substring of the name. The scan's
    kernels at each of `lengths` (the batch keeping SCAN_TOKENS; variants past the reference say "@length x batch")."""
    import torch
    import triton

    from backbones.ops import selective_scan_triton as scan
    from backbones.ops import wkv_triton as wkv
    from backbones.ops import wkv_triton_fused as wkv_fused

    d, g, N = (SCAN_SHAPE[k] for k in ("d", "g", "N"))
    wkv_ints = dict(WKV_SHAPE, n_chunks=triton.cdiv(WKV_SHAPE["T"], wkv.chunk_len(WKV_SHAPE["T"])))
    found = []
    for dtype in dtypes:
        for L, (name, flags), chunk in itertools.product(lengths, flag_sets.items(), (scan.MAX_CHUNK, scan.SHORT_CHUNK)):
            b = max(1, SCAN_TOKENS // L)
            fixed, variant = dict(flags, EXP2=True, BLOCK_N=16, CHUNK=chunk), f"{dtype} {name} L{chunk}"
            variant += f" @{L}x{b}" if L != SCAN_SHAPE["L"] else ""
            n_chunks = triton.cdiv(L, chunk)
            slots = triton.cdiv(d // g, min(scan.backward_cpps(b, g, d // g)))  # as scan_backward allocates them
            ints = dict(SCAN_SHAPE, batch=b, L=L, n_chunks=n_chunks, slots=slots)
            loops = (("N", N), ("n_chunks", n_chunks))
            for constexprs, options in _tuned(scan.fwd_kernel, dict(fixed, STORE_STATES=True)):
                programs = b * g * triton.cdiv(d // g, constexprs["BLOCK_D"])
                found.append(Case("scan.fwd", scan.fwd_kernel.fn, variant, constexprs, options, dtype, ints, loops,
                                  programs, b * d * L * N))
            # The pruner reads the batch, groups and channels, and u's dtype (named_args, as the autotuner passes them).
            inputs = dict(SCAN_SHAPE, batch=b, u_ptr=torch.empty(0, dtype=getattr(torch, TORCH_DTYPES[dtype]), device="meta"))
            for constexprs, options in _tuned(scan.bwd_kernel, fixed, inputs):
                programs = b * g * triton.cdiv(d // g, constexprs["CPP"])
                walk = ((None, constexprs["CPP"] // constexprs["BLOCK_D"]),)  # the channel blocks' loop, outermost
                found.append(Case("scan.bwd", scan.bwd_kernel.fn, variant, constexprs, options, dtype, ints,
                                  loops + walk, programs, b * d * L * N))
        for kname, autotuner in (("wkv.fwd_sums", wkv._fwd_sums_kernel), ("wkv.fwd", wkv._fwd_kernel),
                                 ("wkv.bwd_sums", wkv._bwd_sums_kernel), ("wkv.bwd", wkv._bwd_kernel),
                                 ("wkv.fused_fwd", wkv_fused._fused_fwd_kernel),  # TREAD_WKV_KERNEL=fused
                                 ("wkv.fused_bwd", wkv_fused._fused_bwd_kernel)):
            for constexprs, options in _tuned(autotuner, dict(BLOCK_T=16)):
                # A program per (sequence, channel block, chunk); the fused kernels' per (sequence, channel block),
                # walking the sequence in segments of CHUNKS chunks (two passes, one loop each).
                columns = WKV_SHAPE["B"] * triton.cdiv(WKV_SHAPE["C"], constexprs["BLOCK_C"])
                if "CHUNKS" in constexprs:
                    segments = triton.cdiv(wkv_ints["n_chunks"], constexprs["CHUNKS"])
                    trips, programs = (("n_chunks", segments),), columns
                else:
                    trips, programs = (), columns * wkv_ints["n_chunks"]
                found.append(Case(kname, autotuner.fn, dtype, constexprs, options, dtype, wkv_ints, trips, programs))
        if dtype == dtypes[0]:  # the combine walk reads only fp32 scratch, at the one launch config wkv uses
            for fields in (6, 10):
                found.append(Case(f"wkv.combine{fields}", wkv._combine_kernel, "fp32 scratch",
                                  dict(FIELDS=fields, BLOCK_T=16, BLOCK_C=32, GROUP=wkv._GROUP, PARTS=wkv._GROUP_PARTS),
                                  dict(num_warps=1, num_stages=3, num_ctas=1), "fp32", wkv_ints,
                                  (("n_chunks", triton.cdiv(wkv_ints["n_chunks"], wkv._GROUP)),),
                                  WKV_SHAPE["B"] * triton.cdiv(WKV_SHAPE["C"], 32)))
    return [c for c in found if kernels in c.kernel]


def launch_build(case: Case, arch: int, unspecialised: bool = False):
    """(ASTSource, options) of the kernel the JIT compiles when `case` is launched on sm_<arch>: the arguments go
    through the JITFunction's binder (Triton's specialisation rule and the kernel's do_not_specialize list) and
    `_pack_args`, as `JITFunction.run` does. Pointers are empty meta tensors of their dtype (address 0: 16-byte
    aligned, as torch's allocations are). `unspecialised`: every integer argument as if in do_not_specialize (for
    comparison; not what runs)."""
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
    params = case.fn.params
    if unspecialised:
        params = [copy.copy(p) for p in params]
        for p in params:
            p.do_not_specialize = p.do_not_specialize or p.name in case.ints
    bound, specialization, options = create_function_from_signature(case.fn.signature, params, backend)(**kwargs)
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
    # Warp instructions the whole launch executes per pipe (`PIPES`; loops weighted by `Case.trips`); empty: unknown.
    executed: dict = field(default_factory=dict)

    @property
    def warps_per_sm(self) -> int:
        return occupancy(self.registers, self.case.options["num_warps"], self.shared)

    @property
    def bound(self) -> str:
        """The pipe that takes longest (`PIPES`)."""
        return max(PIPES, key=lambda pipe: self.executed[pipe] / PIPES[pipe])

    @property
    def estimate_ms(self) -> float:
        """Device time on an H100 at the rate of the busiest pipe: an estimate, not a measurement."""
        return 1e3 * self.executed[self.bound] / PIPES[self.bound] / (H100_SMS * H100_CLOCK_HZ)


def occupancy(registers: int, warps: int, shared: int) -> int:
    """Warps of one kernel an sm_90 SM holds at once: whole blocks, limited by registers, shared memory and the
    block and warp limits."""
    per_warp = -(-registers * 32 // SM90_REG_UNIT) * SM90_REG_UNIT
    blocks = min(SM90_REGISTERS // (per_warp * warps), SM90_SHARED // (shared + SM90_BLOCK_RESERVED), SM90_MAX_BLOCKS,
                 SM90_MAX_WARPS // warps)
    return blocks * warps


def compile_case(case: Case, arch: int, unspecialised: bool = False) -> Row:
    """Compiles one case for sm_<arch> and reads its registers and spills from `ptxas -v`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    start = time.perf_counter()
    try:
        src, options = launch_build(case, arch, unspecialised)
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
        ops = _sass(get_ptxas(arch).path, kernel.asm["cubin"], tmp)
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    trips, warps = loops(case, unspecialised), case.options["num_warps"] * case.programs
    executed = {pipe: _executed([op for op in ops if op[1].startswith(prefixes)], trips, all_ops=ops) * warps
                for pipe, prefixes in _PIPE_OPS.items()}
    return Row(case, registers=int(regs.group(1)), spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
               shared=kernel.metadata.shared, seconds=compiled_s, sass=_sass_counts(ops),
               executed=executed if case.programs and executed["issue"] else {})


def _sass(ptxas: str, cubin: bytes, tmp: str) -> list[tuple[int, str, int | None]]:
    """The kernel's SASS as (address, opcode, branch target or None), by the cuobjdump beside the wheel's ptxas."""
    path = os.path.join(tmp, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    listing = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", path], capture_output=True,
                             text=True, check=True).stdout
    # "/*0040*/  @!P0 SHFL.BFLY PT, R2, R0, 0x10, 0x1f ;": the opcode follows the offset and an optional predicate;
    # "/*2280*/  @P4 BRA 0x1190 ;": a branch's target follows its opcode.
    ops = []
    for line in listing.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)\s*(0x[0-9a-f]+)?", line)
        if m:
            ops.append((int(m.group(1), 16), m.group(2), int(m.group(3), 16) if m.group(2) == "BRA" and m.group(3) else None))
    return ops


def _sass_counts(ops: list[tuple[int, str, int | None]]) -> dict:
    """Instructions, exponentials, selects, shuffles and barriers in the kernel's SASS."""
    names = [op for _, op, _ in ops]
    return {"all": len(names), "exp": names.count("MUFU.EX2"), "sel": sum(op.startswith("FSEL") for op in names),
            "shfl": sum(op.startswith("SHFL") for op in names), "bar": sum(op.split(".")[0] == "BAR" for op in names)}


def loops(case: Case, unspecialised: bool = False) -> tuple[int, ...]:
    """The trip counts of the loops `case`'s build has, innermost first: without those over an integer argument of 1
    that the build specialises (a constant: the compiler removes the loop) or over a constexpr 1."""
    specialised = {p.name for p in case.fn.params if not (p.do_not_specialize or unspecialised)}
    return tuple(n for arg, n in case.trips if n != 1 or (arg is not None and arg not in specialised))


def _executed(ops: list[tuple[int, str, int | None]], trips: tuple[int, ...],
              all_ops: list[tuple[int, str, int | None]] | None = None) -> float:
    """Instructions one thread executes: each SASS instruction once per iteration of every loop around it. A loop is
    a backward branch (its target to the branch); its trip count is `trips` at its height (0: a loop with none
    inside, 1: around those, ...). Loops the compiler removed are the outermost (a constant trip count it unrolled, the
    scan's channel walk), so fewer heights than trips take the innermost trips. 0.0 when there are more heights.
    `all_ops`: the whole listing, whose branches make the loops, when `ops` counts a subset of it (one pipe's)."""
    spans = {}
    for addr, _, target in all_ops or ops:
        if target is not None and target < addr:  # a loop's back edge; its header is the target
            spans[target] = max(spans.get(target, addr), addr)
    loops = sorted(spans.items())

    def inside(a, b):  # loop a strictly within loop b
        return a != b and b[0] <= a[0] and a[1] <= b[1]

    height = {}
    for loop in sorted(loops, key=lambda span: span[1] - span[0]):  # inner loops first
        height[loop] = max((height[i] + 1 for i in loops if inside(i, loop) and i in height), default=0)
    if height and max(height.values()) >= len(trips):
        return 0.0
    total = 0.0
    for addr, _, _ in ops:
        weight = 1
        for loop, h in height.items():
            weight *= trips[h] if loop[0] <= addr <= loop[1] else 1
        total += weight
    return total


def table(rows: list[Row]) -> str:
    """One line per row. `occ`: warps per SM; `upd`: warp instructions per state update (the scan's; "-" for the
    others); `est ms`: the launch on an H100 at its busiest pipe's rate, `bound` (`Row.estimate_ms`), an estimate,
    not measured."""
    head = (f"{'kernel':<14} {'variant':<26} {'config':<27} {'regs':>5} {'spill st/ld (B)':>16} {'shared (B)':>11} "
            f"{'occ':>4} {'s':>5} {'SASS':>6} {'exp':>5} {'sel':>5} {'shfl':>5} {'bar':>4} {'upd':>5} {'est ms':>7} "
            f"{'bound':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r.case
        if r.error:
            lines.append(f"{c.kernel:<14} {c.variant:<26} {c.config:<27} FAILED: {r.error}")
        else:
            spill = f"{r.spill_stores}/{r.spill_loads}"
            rate = f"{r.executed['issue'] / c.updates:.2f}" if r.executed and c.updates else "-"
            ms, bound = (f"{r.estimate_ms:.3f}", r.bound) if r.executed else ("-", "-")
            lines.append(f"{c.kernel:<14} {c.variant:<26} {c.config:<27} {r.registers:>5} {spill:>16} {r.shared:>11} "
                         f"{r.warps_per_sm:>4} {r.seconds:>5.1f} {r.sass['all']:>6} {r.sass['exp']:>5} "
                         f"{r.sass['sel']:>5} {r.sass['shfl']:>5} {r.sass['bar']:>4} {rate:>5} {ms:>7} {bound:>5}")
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
    parser.add_argument("--lengths", default=str(SCAN_SHAPE["L"]),
                        help=f"the scan's sequence lengths, comma-separated, each at the batch keeping {SCAN_TOKENS:,} "
                             "tokens: 256 (the reference), or the scaling bench's 256,1024,4096,16384")
    parser.add_argument("--unspecialised", action="store_true",
                        help="build every integer argument unspecialised, as if in do_not_specialize: not what runs, "
                             "for comparison with the launch build")
    args = parser.parse_args(argv)
    check_environment()
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # the seconds column is a compile, never a cache hit
    dtypes = args.dtypes.split(",")
    if bad := [d for d in dtypes if d not in DTYPES]:
        raise ConfigError(f"--dtypes: {bad[0]!r} is not one of {', '.join(DTYPES)}; pass e.g. --dtypes fp32,bf16")
    if args.flags not in ("standard", "every") and (bad := [f for f in args.flags.split(",") if f not in FLAG_SETS]):
        raise ConfigError(f"--flags: {bad[0]!r} is not standard, every or one of {', '.join(FLAG_SETS)}")
    lengths = args.lengths.split(",")
    if bad := [n for n in lengths if not n.isdigit() or int(n) < 1]:
        raise ConfigError(f"--lengths: {bad[0]!r} is not a positive whole number; pass e.g. --lengths 256,1024,4096,16384")
    todo = cases(dtypes, _flag_sets(args.flags), args.kernels, tuple(int(n) for n in lengths))
    if not todo:
        raise ConfigError(f"--kernels: no kernel name contains {args.kernels!r}; try scan, wkv, scan.bwd or wkv.combine")
    built = ("with every integer argument unspecialised (not as launched)" if args.unspecialised
             else "as launched at the reference shapes")
    print(f"compiling {len(todo)} kernel configs for sm_{args.arch} {built} (Triton AOT, no GPU needed)", flush=True)
    rows = []
    for case in todo:
        rows.append(compile_case(case, args.arch, args.unspecialised))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    bad = [r for r in rows if r.error or r.spill_stores > 0]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} compiled without spills for sm_{args.arch}; {len(bad)} failed or spilled")
    return 1 if bad else 0


if __name__ == "__main__":
    from train.cli import friendly_errors

    sys.exit(friendly_errors(main)())
