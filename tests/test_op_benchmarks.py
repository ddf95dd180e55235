"""The op benchmarks run end to end on tiny shapes and report what they promise (no timing is asserted)."""

import sys

from train.bench import routing, scan, wkv


def test_routing_benchmark_reports_a_flop_saving_for_a_routed_tiny_dit():
    (row,) = routing.main(["--presets", "tiny", "--batch", "2", "--repeats", "1", "--warmup", "0", "--threads", "1"])
    assert row["gflops_routed"] < row["gflops_unrouted"] and row["ideal"] > 1
    assert row["mfu_routed"] is None  # no MFU without a known GPU peak


def test_wkv_and_scan_benchmarks_run_on_the_cpu(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["wkv", "--B", "1", "--T", "8", "--C", "4", "--repeats", "1", "--threads", "1"])
    wkv.main()
    monkeypatch.setattr(sys, "argv", ["scan", "--batch", "1", "--dim", "4", "--length", "8", "--state", "2",
                                      "--repeats", "1", "--ref-repeats", "1", "--threads", "1"])
    scan.main()
    out = capsys.readouterr().out
    assert "max |bi_wkv (chunked) - reference|" in out and "sequential reference / ours" in out
