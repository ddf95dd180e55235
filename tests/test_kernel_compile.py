"""train.bench.kernel_compile: every autotune config of the Triton kernels compiles for sm_90 without a GPU.

Compiling runs in a subprocess with TRITON_INTERPRET=0 (this suite interprets the kernels, conftest.py) and a
fresh Triton cache, so every kernel is really compiled. Importing torch and Triton alone takes ~4 s, so even the
smallest subset (3 configs, ~7 s on the 2-core dev box) is marked slow; only the refusal runs by default.
"""

from __future__ import annotations

import re

import pytest

from conftest import run_module

# A table row: kernel, variant, config (three or four words: a register budget), registers, spill stores/loads, shared
# bytes, warps per SM, seconds (not captured), then the SASS's instructions, exponentials, selects (not captured),
# shuffles and barriers, the warp instructions per state update, the estimated ms and its bound pipe ("-" where there
# is none).
_ROW = re.compile(r"^(\S+)\s+(.+?)\s+(BLOCK_\S+ w\d+ s\d+(?: r\d+)?)\s+(\d+)\s+(\d+)/(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+"
                  r"\s+(\d+)\s+(\d+)\s+\d+\s+(\d+)\s+(\d+)\s+([\d.]+|-)\s+([\d.]+|-)\s+(issue|mufu|shfl|-)$")


def _compile(tmp_path, *args: str, timeout: float = 300):
    result = run_module("train.bench.kernel_compile", "--arch", "90", *args, timeout=timeout,
                        env={"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")})
    summary = result.stdout.split("\n\n")[1] if "\n\n" in result.stdout else ""  # the final table
    rows = [m.groups() for line in summary.splitlines() if (m := _ROW.match(line))]
    return result, rows


def _check(result, rows, expected: int):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"compiling {expected} kernel configs for sm_90 as launched at the reference shapes" in result.stdout
    assert len(rows) == expected, result.stdout
    for kernel, variant, config, regs, stores, loads, shared, *_ in rows:
        assert 0 < int(regs) <= 255, (kernel, variant, config, regs)
        assert (int(stores), int(loads)) == (0, 0), (kernel, variant, config, "spills")
    assert f"{expected} of {expected} compiled without spills" in result.stdout


def test_executed_weights_each_instruction_by_its_loops():
    """The estimate's instruction count: a backward branch closes a loop; each instruction counts once per iteration of
    every loop around it, the innermost loop taking the first trip count."""
    from train.bench.kernel_compile import _executed

    ops = [(0x00, "MOV", None),  # before any loop: once
           (0x10, "LDG", None), (0x20, "FFMA", None), (0x30, "FFMA", None), (0x40, "BRA", 0x20),  # inner: 0x20-0x40
           (0x50, "STG", None), (0x60, "BRA", 0x10),  # outer: 0x10-0x60
           (0x70, "EXIT", None), (0x80, "BRA", 0x80)]  # the listing's closing self-branch is no loop
    assert _executed(ops, (16, 4)) == 1 + 4 * (1 + 16 * 3 + 2) + 2
    assert _executed(ops, (16, 4, 8)) == 1 + 4 * (1 + 16 * 3 + 2) + 2  # a trip with no loop (unrolled walk): none
    assert _executed(ops, (16,)) == 0.0  # more loops than trips: no estimate
    # One pipe's instructions, the loops read from the whole listing: the two FFMAs of the inner loop.
    assert _executed([op for op in ops if op[1] == "FFMA"], (16, 4), all_ops=ops) == 4 * 16 * 2


def test_the_estimate_is_the_busiest_pipe():
    """Per SM and cycle an H100 issues 4 warp instructions, half a MUFU and one shuffle: the launch takes what its
    busiest pipe needs."""
    from train.bench.kernel_compile import H100_CLOCK_HZ, H100_SMS, Case, Row

    case = Case("k", None, "", {}, {"num_warps": 4}, "bf16", {})
    shuffles = Row(case, executed={"issue": 4e6, "mufu": 0.0, "shfl": 2e6})  # 2 M shuffles outlast 4 M issues
    assert shuffles.bound == "shfl"
    assert shuffles.estimate_ms == pytest.approx(1e3 * 2e6 / (H100_SMS * H100_CLOCK_HZ))
    assert Row(case, executed={"issue": 4e6, "mufu": 0.6e6, "shfl": 0.0}).bound == "mufu"
    assert Row(case, executed={"issue": 4e6, "mufu": 0.4e6, "shfl": 0.5e6}).bound == "issue"


def test_occupancy_counts_whole_blocks():
    """Warps per SM on sm_90: registers allocated per warp in units of 256 of 65,536; shared memory 228 KB, 1 KB
    reserved per block; at most 32 blocks and 64 warps."""
    from train.bench.kernel_compile import occupancy

    assert occupancy(218, 1, 0) == 9  # 218 x 32 = 6,976 -> 7,168 registers a warp
    assert occupancy(72, 4, 512) == 28  # 9,216 a block: 7 blocks
    assert occupancy(32, 1, 0) == 32  # the block limit before the warp limit
    assert occupancy(32, 4, 100 * 1024) == 8  # shared memory for two blocks
    assert occupancy(255, 8, 0) == 8  # 8,192 a warp: one block of 8 warps fills the register file


def test_loops_without_the_constant_chunk_loop():
    """The scan's one-chunk launch (n_chunks == 1, a constant when specialised) has no chunk loop; built unspecialised,
    or with n_chunks in do_not_specialize, it has. The scan's kernels leave d, N (and backward's batch and slots)
    unspecialised (selective_scan_triton_kernels._SHAPE_ARGS)."""
    from types import SimpleNamespace

    from backbones.ops import selective_scan_triton as sst
    from train.bench.kernel_compile import Case, loops

    def kernel(*unspecialised):
        return SimpleNamespace(params=[SimpleNamespace(name=n, do_not_specialize=n in unspecialised) for n in ("N", "n_chunks")])

    trips = (("N", 16), ("n_chunks", 1), (None, 4))  # the backward's: states, chunks, the channel walk
    assert loops(Case("scan.bwd", kernel(), "", {}, {}, "bf16", {}, trips)) == (16, 4)
    assert loops(Case("scan.bwd", kernel(), "", {}, {}, "bf16", {}, trips), unspecialised=True) == (16, 1, 4)
    assert loops(Case("scan.bwd", kernel("n_chunks"), "", {}, {}, "bf16", {}, trips)) == (16, 1, 4)
    assert loops(Case("scan.bwd", kernel(), "", {}, {}, "bf16", {}, (("N", 16), ("n_chunks", 1), (None, 1)))) == (16,)

    def unspecialised(fn):  # the JITFunction's list, or the interpreter's (TRITON_INTERPRET=1) keyword
        return set(fn.do_not_specialize if hasattr(fn, "params") else fn.kwargs["do_not_specialize"])

    assert unspecialised(sst.bwd_kernel.fn) == {"batch", "d", "N", "slots"}
    assert unspecialised(sst.fwd_kernel.fn) == {"d", "N"}


def test_a_bad_length_is_one_sentence(monkeypatch):
    from routing import ConfigError
    from train.bench.kernel_compile import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # past the environment check; the lengths are checked before compiling
    with pytest.raises(ConfigError, match=r"^--lengths: 'abc' is not a positive whole number; pass e\.g\. --lengths "):
        main(["--lengths", "256,abc"])


def test_refuses_under_the_interpreter():
    result = run_module("train.bench.kernel_compile", env={"TRITON_INTERPRET": "1"}, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: TRITON_INTERPRET is set, so the kernels are interpreted Python and cannot be compiled; "
        "run with TRITON_INTERPRET=0 (or unset it)"]


@pytest.mark.slow
def test_forward_scan_configs_compile_for_sm90_without_spills(tmp_path):
    """The Mamba block's forward (bf16; D, delta_bias, softplus): every autotune config of both chunk lengths, ~10 s."""
    result, rows = _compile(tmp_path, "--kernels", "scan.fwd", "--dtypes", "bf16", "--flags", "model")
    _check(result, rows, expected=4 + 3)  # the 256-step chunk's configs, then the 64-step chunk's
    assert {r[2] for r in rows} == {"BLOCK_D=2 w4 s3", "BLOCK_D=4 w4 s3", "BLOCK_D=4 w8 s3", "BLOCK_D=8 w16 s3 r128",
                                    "BLOCK_D=1 w1 s3", "BLOCK_D=2 w1 s3", "BLOCK_D=4 w2 s3"}  # r128: its register budget
    assert all(float(r[12]) > 0 and float(r[13]) > 0 for r in rows), rows  # every scan row has its estimate


@pytest.mark.slow
def test_specialised_length_keeps_steps_in_thread(tmp_path):
    """Why L stays specialised (selective_scan_triton_kernels._SHAPE_ARGS): at L = 256 its divisibility by 16 vectorises
    the loads along time, so each thread composes its steps in registers; built with every integer unspecialised, the
    same forward configs take more shuffles and more instructions per state update. ~30 s."""
    launched, unspecialised = (_compile(tmp_path, "--kernels", "scan.fwd", "--dtypes", "bf16", "--flags", "model", *extra)
                               for extra in ((), ("--unspecialised",)))
    assert launched[0].returncode == 0 and unspecialised[0].returncode == 0, unspecialised[0].stdout[-2000:]
    pairs = list(zip(launched[1], unspecialised[1]))
    assert len(pairs) == 7 and all(a[2] == b[2] for a, b in pairs)
    for a, b in pairs:
        assert int(a[10]) < int(b[10]) and float(a[12]) < float(b[12]), (a, b)


@pytest.mark.slow
def test_scan_compiles_without_spills_at_the_scaling_lengths(tmp_path):
    """The Mamba block's scan (bf16; D, delta_bias, softplus) at 1,024, 4,096 and 16,384 tokens, the batch keeping
    16,384 tokens (16, 4, 1): every shipped config of both chunk lengths, as launched, without a spill. ~4 min."""
    result, rows = _compile(tmp_path, "--kernels", "scan", "--dtypes", "bf16", "--flags", "model",
                            "--lengths", "1024,4096,16384", timeout=900)
    _check(result, rows, expected=3 * (4 + 3 * 3 + 3 + 2 * 3))
    assert {r[1].split("@")[1] for r in rows} == {"1024x16", "4096x4", "16384x1"}
    assert all(r[12] != "-" for r in rows), rows


@pytest.mark.slow
def test_wkv_walks_are_unrolled_for_sm90(tmp_path):
    """The chunk sums walk 16 rows twice with two exponentials a step: 64 MUFU.EX2 in the SASS only when LLVM
    unrolled every 2-step loop (wkv_triton_walks._PARTS); a loop left rolled has fewer, and picks rows by selects."""
    result, rows = _compile(tmp_path, "--kernels", "wkv.fwd_sums", "--dtypes", "bf16")
    _check(result, rows, expected=2)
    assert {int(r[9]) for r in rows} == {64}, rows


@pytest.mark.slow
def test_wkv_rows_stay_in_thread_as_launched(tmp_path):
    """Built as the JIT builds them at B64 T256 C384 (bf16, every kernel and config, ~2 min): no shuffle and no
    barrier, so each chunk's 16 rows sit in one thread. Without do_not_specialize on the shape arguments, C's
    divisibility by 16 vectorised the loads along channels: the backward had 3,648 shuffles and 241 barriers.
    The one-launch kernels (TREAD_WKV_KERNEL=fused) exchange chunk carries across warps in their scans: about a
    hundred shuffles and a few barriers per kernel, where rows spread over lanes would take thousands."""
    result, rows = _compile(tmp_path, "--kernels", "wkv", "--dtypes", "bf16", timeout=1200)
    _check(result, rows, expected=4 * 2 + 2 + 2)
    chunked = [r for r in rows if not r[0].startswith("wkv.fused")]
    assert {(r[0], int(r[10]), int(r[11])) for r in chunked} == {(r[0], 0, 0) for r in chunked}, rows
    assert all(int(r[10]) <= 128 and int(r[11]) <= 8 for r in rows if r[0].startswith("wkv.fused")), rows
    # Every launch has its estimate: no loop but the fused kernels' segment loop, whose trips the tool knows.
    assert all(r[13] != "-" and r[14] == "issue" for r in rows), rows


@pytest.mark.slow
def test_every_kernel_config_compiles_for_sm90_as_launched(tmp_path):
    """Both ops, forward and backward, fp32 and bf16, scan flag sets none / model / all, each built as the JIT builds
    it at launch: ~20 min on 2 busy cores. No shipped config spills (the scan's small backward blocks with their
    register budgets, selective_scan_triton.BWD_MAXNREG)."""
    result, rows = _compile(tmp_path, timeout=3600)
    # Scan, per dtype and flag set: chunks of 256, 4 forward + 3 backward block configs x 3 CPPs; chunks of 64,
    # 3 forward + 2 backward x 3 CPPs. Then the Bi-WKV kernels.
    scan_rows = [r for r in rows if r[0].startswith("scan.")]
    assert len(scan_rows) == 2 * 3 * ((4 + 3 * 3) + (3 + 2 * 3)), result.stdout
    _check(result, rows, expected=len(rows))
    assert {r[0] for r in rows} == {"scan.fwd", "scan.bwd", "wkv.fwd_sums", "wkv.fwd", "wkv.bwd_sums", "wkv.bwd",
                                    "wkv.combine6", "wkv.combine10", "wkv.fused_fwd", "wkv.fused_bwd"}
