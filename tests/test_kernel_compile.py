"""train.bench.kernel_compile: every autotune config of the Triton kernels compiles for sm_90 without a GPU.

Compiling runs in a subprocess with TRITON_INTERPRET=0 (this suite interprets the kernels, conftest.py) and a
fresh Triton cache, so every kernel is really compiled. Importing torch and Triton alone takes ~4 s, so even the
smallest subset (3 configs, ~7 s on the 2-core dev box) is marked slow; only the refusal runs by default.
"""

from __future__ import annotations

import re

import pytest

from conftest import run_module

# A table row: kernel, variant, config (three words), registers, spill stores/loads, shared bytes, seconds, then the
# SASS's instructions, exponentials, selects (not captured), shuffles and barriers.
_ROW = re.compile(r"^(\S+)\s+(.+?)\s+(BLOCK_\S+ w\d+ s\d+)\s+(\d+)\s+(\d+)/(\d+)\s+(\d+)\s+[\d.]+\s+(\d+)\s+(\d+)\s+\d+"
                  r"\s+(\d+)\s+(\d+)$")


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
    assert {r[2] for r in rows} == {"BLOCK_D=2 w4 s3", "BLOCK_D=4 w4 s3", "BLOCK_D=4 w8 s3", "BLOCK_D=8 w16 s3",
                                    "BLOCK_D=1 w1 s3", "BLOCK_D=2 w1 s3", "BLOCK_D=4 w2 s3"}


@pytest.mark.slow
def test_wkv_walks_are_unrolled_for_sm90(tmp_path):
    """The chunk sums walk 16 rows twice with two exponentials a step: 64 MUFU.EX2 in the SASS only when LLVM
    unrolled every 2-step loop (wkv_triton_walks._PARTS); a loop left rolled has fewer, and picks rows by selects."""
    result, rows = _compile(tmp_path, "--kernels", "wkv.fwd_sums", "--dtypes", "bf16")
    _check(result, rows, expected=2)
    assert {int(r[8]) for r in rows} == {64}, rows


@pytest.mark.slow
def test_wkv_rows_stay_in_thread_as_launched(tmp_path):
    """Built as the JIT builds them at B64 T256 C384 (bf16, every kernel and config, ~2 min): no shuffle and no
    barrier, so each chunk's 16 rows sit in one thread. Without do_not_specialize on the shape arguments, C's
    divisibility by 16 vectorised the loads along channels: the backward had 3,648 shuffles and 241 barriers."""
    result, rows = _compile(tmp_path, "--kernels", "wkv", "--dtypes", "bf16", timeout=900)
    _check(result, rows, expected=4 * 2 + 2)
    assert {(r[0], int(r[9]), int(r[10])) for r in rows} == {(r[0], 0, 0) for r in rows}, rows


@pytest.mark.slow
def test_every_kernel_config_compiles_for_sm90_as_launched(tmp_path):
    """Both ops, forward and backward, fp32 and bf16, scan flag sets none / model / all, each built as the JIT builds
    it at launch: ~20 min on 2 busy cores. A shipped config spills only where every candidate does: the fp32
    short-chunk backward without z keeps its 2-warp config, which spills 4 (none) or 8 (model) bytes
    (selective_scan_triton._short_backward); the exit status says so."""
    result, rows = _compile(tmp_path, timeout=3600)
    # Scan, chunks of 256: (4 forward + 3 backward block configs x 3 CPPs) x 3 flag sets; chunks of 64: 3 forward
    # configs x 3 flag sets; both x 2 dtypes. The short backward, x 3 CPPs: one config per flag set in fp32, in bf16
    # one (none, model) or two (all). WKV: (2 + 2 + 2 + 2) x 2 dtypes + 2 combines.
    expected = 2 * ((4 + 3 * 3) * 3 + 3 * 3) + 3 * 3 + (1 + 1 + 2) * 3 + 8 * 2 + 2
    assert f"compiling {expected} kernel configs for sm_90 as launched at the reference shapes" in result.stdout
    assert len(rows) == expected, result.stdout
    spilling = {(kernel, variant, config, int(stores)) for kernel, variant, config, regs, stores, *_ in rows if int(stores)}
    assert {(k, v, int(b)) for k, v, _, b in spilling} == {("scan.bwd", "fp32 none L64", 4), ("scan.bwd", "fp32 model L64", 8)}
    assert len(spilling) == 6 and all(" w2 " in config for _, _, config, _ in spilling)
    assert result.returncode == 1 and f"{expected - 6} of {expected} compiled without spills" in result.stdout
    assert {r[0] for r in rows} == {"scan.fwd", "scan.bwd", "wkv.fwd_sums", "wkv.fwd", "wkv.bwd_sums", "wkv.bwd",
                                    "wkv.combine6", "wkv.combine10"}
