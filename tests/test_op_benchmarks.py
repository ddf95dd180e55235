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


def test_sampling_study_rules_parse_and_refuse_bad_routing_guidance():
    import pytest

    from routing import ConfigError
    from train.bench.sampling import rules

    names = [r.name for r in rules([0, 0.5], [2.0], ["2,0,0.5"])]
    assert names == ["plain", "routed 0.5", "CFG 2", "RG 2 (0/0.5)"]  # ratio 0 is the plain rule itself
    with pytest.raises(ConfigError, match="gamma_1 <= gamma_2"):
        rules([], [], ["2,0.7,0.3"])
    with pytest.raises(ConfigError, match="scale,gamma_1,gamma_2"):
        rules([], [], ["2"])
