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
    # Device time beside the synchronous wall time: CUDA events on a GPU; on a CPU the bench says it is the wall.
    assert out.count("fwd+bwd  device time n/a on CPU (= wall)") == 3  # chunked, reference; ours (the scan's one row)


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


def test_sampling_study_groups_training_seeds_and_compares_objectives(tmp_path, monkeypatch, capsys):
    import json
    import shutil

    import pytest

    from conftest import run_cli
    from train.bench import sampling

    # The flow bench takes its routed budget from another bench's measured speedup (train.speedups_from): here a
    # cost.json whose routed step is exactly twice as fast, so train.steps={dit: 3} gives its routed cells 6 steps.
    other = tmp_path / "cost.json"
    other.write_text(json.dumps({"cells": {"dit-none": {"flops": 2.0, "step_seconds": 2.0},
                                           "dit-random": {"flops": 1.0, "step_seconds": 1.0}}}))
    budgets = {"edm": [], "flow": ["train.steps={dit: 3}", f"train.speedups_from={other}"]}
    runs = []
    (tmp_path / "disk").mkdir()
    (tmp_path / "flow").symlink_to(tmp_path / "disk")  # the flow runs live behind a symlink (a bigger disk)
    for objective in ("edm", "flow"):
        out = tmp_path / objective
        done = run_cli("train.bench", "bench=smoke", f"out_dir={out}", "grid.backbones=[dit]", "grid.routings=[random]",
                          "seeds=[0,1]", "eval.keep_final=true", f"overrides=[\"data.resolution=8\",\"objective={objective}\"]",
                          *budgets[objective])
        assert done.returncode == 0, done.stderr[-3000:]
        runs += [f"{objective}/runs/dit-random-s{seed}" for seed in (0, 1)]
    monkeypatch.chdir(tmp_path)  # runs given relative to the working directory, as a user in a clone gives them
    study = [*runs, "--gammas", "0.5", "--cfg", "2", "--rg", "2,0,0.5", "2,0,0.5,uncond", "--steps", "2", "--per-class", "2",
             "--num-real", "16", "--cache-dir", str(tmp_path / "edm" / "classifier"), "--threads", "1", "--out", str(tmp_path / "study")]
    sampling.main(study[:2] + study[4:])  # the EDM runs first (a separate process could take the flow runs)
    edm_study = tmp_path / "edm-study.json"
    edm_study.write_text((tmp_path / "study" / "table.json").read_text())
    sampling.main(study)  # all runs: the EDM rows are reused, not sampled again
    saved = sorted((tmp_path / "study" / "rows").glob("*.json"))
    assert len(saved) == 4 * 5
    # Rows name their checkpoint relative to the working directory, so rows committed from one clone serve another.
    for row in saved:
        assert json.loads(row.read_text())["settings"]["checkpoint"].startswith(("edm/runs/", "flow/runs/")), row.name
    mtimes = [p.stat().st_mtime_ns for p in saved]
    first = json.loads((tmp_path / "study" / "table.json").read_text())
    sampling.main(study)
    assert [p.stat().st_mtime_ns for p in saved] == mtimes
    table = json.loads((tmp_path / "study" / "table.json").read_text())
    assert table["rows"] == first["rows"]
    agg = {(a["group"], a["rule"]): a for a in table["aggregate"]}
    assert {g for g, _ in agg} == {"edm dit-random", "flow dit-random"}
    assert agg[("edm dit-random", "plain")]["steps_trained"] == 2 and agg[("flow dit-random", "plain")]["steps_trained"] == 6
    assert all(a["runs"] == 2 for a in agg.values())
    # Network evaluations per image: Heun with 2 steps is 3 for EDM (no correction at sigma = 0) and 4 for flow;
    # CFG and routing guidance evaluate twice per step, routed inference once.
    for group, plain in (("edm dit-random", 3), ("flow dit-random", 4)):
        assert agg[(group, "plain")]["evaluations"] == agg[(group, "routed 0.5")]["evaluations"] == plain
        assert agg[(group, "CFG 2")]["evaluations"] == agg[(group, "RG 2 (0/0.5)")]["evaluations"] == 2 * plain
        assert agg[(group, "routed 0.5")]["gflops_per_image"] < agg[(group, "plain")]["gflops_per_image"]
        assert agg[(group, "RG 2 (0/0.5)")]["gflops_per_image"] < agg[(group, "CFG 2")]["gflops_per_image"]
        assert "classifier_fd_vs_plain" in agg[(group, "CFG 2")] and "classifier_fd_vs_plain" not in agg[(group, "plain")]
    assert {c["rule"] for c in table["between_groups"]} == {"plain", "routed 0.5", "CFG 2", "RG 2 (0/0.5)", "RG 2 (0/0.5, uncond)"}
    assert (tmp_path / "study" / "quality_vs_flops.png").stat().st_size > 0
    # An earlier study's table.json stands for runs whose checkpoints are gone: pooled with the flow runs, it gives
    # the table of the study over all runs.
    shutil.rmtree(tmp_path / "edm" / "runs")
    flags = study[4:-1]
    sampling.main([str(edm_study), *runs[2:], *flags, str(tmp_path / "pooled")])
    again = json.loads((tmp_path / "pooled" / "table.json").read_text())
    assert again["rows"] == table["rows"] and again["aggregate"] == table["aggregate"]
    # Sources sampled or scored differently are refused in one sentence naming the setting.
    capsys.readouterr()
    for source, extra, says in ((str(edm_study), ["--steps", "3"], "--steps differs between the sources"),
                                (str(edm_study), ["--num-real", "8"], "differ in --num-real"),
                                (str(tmp_path / "cost.json"), [], "is not a table.json written by")):
        with pytest.raises(SystemExit):
            sampling.main([source, *runs[2:], *flags, str(tmp_path / "refused"), *extra])
        err = capsys.readouterr().err
        assert says in err.splitlines()[-1] and "Traceback" not in err and err.count("error:") == 1, err
