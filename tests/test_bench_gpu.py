"""`python -m train.bench.gpu`: its dry run covers every section, its budget skips and stops, its checks can fail,
and a bad argument gets one sentence. The dry run runs the kernels through Triton's interpreter (conftest.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from train.bench import gpu, gpu_checks, gpu_report, gpu_speed
from train.bench.gpu_budget import PROGRESS, Section, run_sections


def test_dry_run_writes_every_section(tmp_path, capsys):
    report = gpu.main(["--dry-run", "--out", str(tmp_path / "out")])
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    md = (tmp_path / "out" / "report.md").read_text()
    assert [s["name"] for s in saved["sections"]] == list(gpu.SECTION_NAMES)
    for section in saved["sections"]:
        # A dry run has time for everything, and every section's code runs without an error.
        assert section["status"] in ("passed", "measured"), (section["name"], section["note"])
        assert section["records"], section["name"]
        assert f"{section['title']}: **{section['status']}**" in md
    for heading in ("Kernels against their references", "Families on the device against the CPU", "Kernels at their reference shapes",
                    "Training steps (train.bench.routing)", "python -m train against the bare step"):
        assert f"## {heading}" in md
    env = saved["environment"]
    assert env["torch"] == torch.__version__ and env["triton"] and "device" in env and "commit" in env
    kernels = {(r["kernel"], r["precision"]) for s in saved["sections"] if s["name"] == "kernels" for r in s["records"]}
    assert kernels == {("selective scan (Triton)", p) for p in ("fp32", "bf16", "fp32, decay -1e5")} | {("Bi-WKV (Triton)", p) for p in ("fp32", "bf16")}
    families = {(r["family"], r["precision"]) for s in saved["sections"] if s["name"] == "families" for r in s["records"]}
    assert families == {(f, p) for f in ("dit", "rwkv", "mamba", "diffmoe") for p in ("fp32", "bf16")}
    # Every kernel row names the config each autotuned kernel it ran picked (the interpreter has one config each).
    tuned = {r["kernel"]: r["tuned"] for s in saved["sections"] if s["name"] == "kernel-speed" for r in s["records"]}
    assert set(tuned["selective scan"]) == {"fwd_kernel", "bwd_kernel"} and len(tuned["Bi-WKV"]) == 4
    assert set(tuned["selective scan, 64-step chunks"]) == {"fwd_kernel", "bwd_kernel"}  # TREAD_SCAN_CHUNK=64 beside it
    assert all(t["picked"].startswith("BLOCK_") and t["ms"] == {} for k in tuned.values() for t in k.values())
    assert "fwd_kernel: BLOCK_D=" in md
    # And where one forward+backward's time goes, launch by launch (the CPU's ops in a dry run).
    launches = [r["launches"] for s in saved["sections"] if s["name"] == "kernel-speed" for r in s["records"]]
    assert all(rows and all(x["us"] > 0 and x["calls"] >= 1 for x in rows) for rows in launches)
    assert "Launches of one selective scan bf16 forward+backward" in md
    trainer = next(s for s in saved["sections"] if s["name"] == "trainer")["records"][0]
    assert trainer["trainer_images_per_s"] > 0 and trainer["ratio"] > 0
    # Tiny shapes on a CPU decide no goal, but every goal is listed.
    assert len(saved["goals"]) == 11 and all(g["met"] is None for g in saved["goals"])
    assert report["sections"][0]["records"][0]["passed"]
    out = capsys.readouterr().out
    assert "[" in out and "kernels:" in out and "wrote" in out  # progress lines


def test_tuned_configs_name_the_pick_and_every_configs_time():
    import types

    import triton

    @triton.jit
    def kernel(x):
        pass

    configs = [triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=8)]
    tuned, untouched = (triton.autotune(configs=configs, key=[])(kernel) for _ in range(2))
    tuned.best_config, tuned.configs_timings = configs[1], {configs[0]: [0.5, 0.4, 0.6], configs[1]: [0.25, 0.2, 0.3]}
    got = gpu_speed.tuned_configs(types.SimpleNamespace(a_kernel=tuned, never_run=untouched, other=1))
    assert got == {"a_kernel": {"picked": "BLOCK=32 warps=8", "ms": {"BLOCK=16 warps=4": 0.5, "BLOCK=32 warps=8": 0.25}}}
    assert gpu_report._tuned_cell(got) == "a_kernel: BLOCK=32 warps=8 (0.250 of 0.500 ms, 2 configs)"


def _sections(calls: list[str], estimates: dict[str, float], raise_in: str = "") -> list[Section]:
    def run(name):
        calls.append(name)
        if name == raise_in:
            raise RuntimeError("the kernel broke\nsecond line of detail")
        return {"status": "measured", "records": [{"name": name}]}

    return [Section(name, name.upper(), "steps", estimate, lambda name=name: run(name)) for name, estimate in estimates.items()]


def test_budget_runs_in_order_and_skips_what_does_not_fit():
    now = [0.0]
    calls: list[str] = []
    lines: list[str] = []

    def clock():
        return now[0]

    sections = _sections(calls, {"a": 30, "b": 50, "c": 40, "d": 10})
    for s in sections:  # each section takes exactly its estimate on the fake clock
        s.run = (lambda f, est: lambda: (now.__setitem__(0, now[0] + est), f())[1])(s.run, s.estimate_s)
    results = run_sections(sections, budget_s=85, clock=clock, log=lines.append)
    # a (0-30) and b (30-80) run; c needs 40 with 5 left: skipped; d needs 10: skipped too; order kept.
    assert calls == ["a", "b"]
    assert [r["status"] for r in results] == ["measured", "measured", "skipped", "skipped"]
    assert results[2]["note"] == "needs about 40 s, 5 s of the budget left"
    assert any(line.endswith("skip c: needs about 40 s, 5 s of the budget left") for line in lines)
    assert results[0]["records"] == [{"section": "a", "name": "a"}]


def test_a_section_that_raises_is_one_line_and_the_run_goes_on():
    calls: list[str] = []
    results = run_sections(_sections(calls, {"a": 1, "b": 1}, raise_in="a"), budget_s=100, log=lambda line: None)
    assert calls == ["a", "b"]
    assert results[0]["status"] == "error" and results[0]["note"] == "RuntimeError: the kernel broke"
    assert results[1]["status"] == "measured"


def _forever():
    time.sleep(30)
    return {"status": "measured", "records": []}


def test_a_section_past_three_times_its_estimate_is_stopped_and_the_next_runs():
    calls: list[str] = []
    sections = [Section("hangs", "hangs", "steps", 0.1, _forever), *_sections(calls, {"after": 0.1})]
    results = run_sections(sections, budget_s=100, log=lambda line: None)
    assert results[0]["status"] == "stopped" and results[0]["seconds"] < 10
    assert results[0]["note"] == "still running after 0 s (3 x its estimate), stopped; 0 finished records kept"
    assert results[1]["status"] == "measured" and calls == ["after"]


def test_a_stopped_section_keeps_the_records_it_finished():
    """A section that hands over two records and then hangs (a compile that never ends) is stopped, and its report
    still holds the two records; the log has a line for each."""

    def two_then_hang():
        def records():
            yield {"kernel": "k", "precision": "fp32", "passed": True}
            yield {"kernel": "k", "precision": "bf16", "passed": False}
            time.sleep(30)
        return {"status": "passed", "records": PROGRESS.collect(records())}

    lines: list[str] = []
    results = run_sections([Section("hangs", "hangs", "kernel_checks", 0.2, two_then_hang)], budget_s=100, log=lines.append)
    assert results[0]["status"] == "stopped" and results[0]["seconds"] < 10
    assert [r["precision"] for r in results[0]["records"]] == ["fp32", "bf16"]
    assert results[0]["records"][0]["section"] == "hangs" and "2 finished records kept" in results[0]["note"]
    assert any(line.endswith("k fp32: passed") for line in lines) and any(line.endswith("k bf16: FAILED") for line in lines)


def test_a_section_past_the_budget_is_stopped():
    calls: list[str] = []
    sections = [Section("slow", "slow", "steps", 0.1, _forever), *_sections(calls, {"after": 0.1})]
    # A dry run's estimates are nominal: only the whole budget (x 1.25) stops a section there.
    results = run_sections(sections, budget_s=1.2, dry_run=True, log=lambda line: None)
    assert results[0]["status"] == "stopped" and "1.25 x the budget" in results[0]["note"] and results[0]["seconds"] < 10
    assert results[1]["status"] == "skipped" and calls == []


def test_a_kernel_that_differs_from_its_reference_fails():
    inputs = {"x": torch.randn(4, 8, dtype=torch.float64)}
    upstream = torch.randn(4, 8, dtype=torch.float64)
    good = gpu_checks._compare("k", "fp32", "4x8", lambda x: torch.tanh(x).float(), torch.tanh, inputs, upstream)
    bad = gpu_checks._compare("k", "fp32", "4x8", lambda x: torch.tanh(x * 1.001).float(), torch.tanh, inputs, upstream)
    assert good["passed"] and not bad["passed"] and bad["y_error"] > 1e-4


def test_a_broken_kernel_is_a_row_and_the_other_kernel_is_still_checked(monkeypatch):
    import backbones.ops.wkv

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here\ndetail")

    monkeypatch.setattr(backbones.ops.wkv, "bi_wkv", broken)
    checks = list(gpu_checks.kernel_checks(torch.device("cpu"), (1, 4, 8, 4), (1, 8, 4)))
    assert [c["passed"] for c in checks] == [True, True, True, False, False]
    assert checks[3] == {"kernel": "Bi-WKV (Triton)", "precision": "fp32", "shape": "B1 T8 C4",
                         "error": "RuntimeError: no kernel here", "passed": False}


def test_a_family_that_differs_on_the_device_fails(monkeypatch):
    """The device copy with one weight changed by 1%: the fp32 comparison must see it (and the zero layers are
    redrawn, so the output is not trivially zero on both sides)."""
    real_copy = gpu_checks.device_copy

    def perturbed(model, device):
        copy = real_copy(model, device)
        with torch.no_grad():
            copy.final_layer.linear.weight.mul_(1.01)
        return copy

    monkeypatch.setattr(gpu_checks, "FAMILIES", ("dit",))
    fp32, _ = gpu_checks.family_checks(torch.device("cpu"), "tiny", 8, 2, 2)
    assert fp32["passed"] and fp32["redrawn_zero_layers"] > 0
    monkeypatch.setattr(gpu_checks, "device_copy", perturbed)
    fp32, _ = gpu_checks.family_checks(torch.device("cpu"), "tiny", 8, 2, 2)
    assert not fp32["passed"] and fp32["output_error"] > 1e-3


@pytest.mark.parametrize("help_line, modes, argv", [
    ("  --compile             torch.compile every block", ("off", "blocks"), ["--compile"]),
    ("  --compile {off,blocks,model}  compile mode", ("off", "blocks", "model"), ["--compile", "blocks"]),
    ("  --compile COMPILE     compile mode", ("off", "blocks", "model"), ["--compile", "blocks"]),
    ("  [--compile [{off,blocks,model}]]", ("off", "blocks", "model"), ["--compile", "blocks"]),
])
def test_the_compile_mode_follows_what_routing_offers(monkeypatch, help_line, modes, argv):
    def fake_main(args):
        print(f"usage: ...\n{help_line}")
        raise SystemExit(0)

    monkeypatch.setattr(gpu_speed.routing, "main", fake_main)
    gpu_speed._routing_help.cache_clear()
    try:
        assert gpu_speed.routing_compile_modes()[0] == modes
        assert gpu_speed.routing_compile_argv("blocks") == argv
        assert gpu_speed.routing_compile_argv("off") == ([] if argv == ["--compile"] else ["--compile", "off"])
        assert gpu_speed.best_compile_mode() == modes[-1]
    finally:
        gpu_speed._routing_help.cache_clear()


def test_a_scan_family_that_does_not_compile_is_measured_a_lesser_way(monkeypatch):
    asked = []

    def fake_main(argv):
        if argv == ["--help"]:
            print("  [--compile [{off,blocks,model}]]\n  --cuda-graphs")
            raise SystemExit(0)
        mode = argv[argv.index("--compile") + 1]
        asked.append(mode + (" +regions" if "--compile-regions" in argv else ""))
        if mode != "off":
            raise RuntimeError(f"{mode}: graph break in the scan\nmore")
        return [{"preset": "S", "ms_routed": 1.0}]

    monkeypatch.setattr(gpu_speed.routing, "main", fake_main)
    gpu_speed._routing_help.cache_clear()
    try:
        row = gpu_speed.step_row("mamba", "S", "rows", 2, 4, 8, "cpu", False, "model", 1, 0, cuda_graphs=True, fall_back=True,
                                 regions=True)
        # Regions go with the asked mode only: the lesser modes are tried without them.
        assert asked == ["model +regions", "blocks", "off"] and row["compile"] == "off" and not row["cuda_graphs"]
        assert not row["regions"]
        assert row["note"] == ("compile=model with regions with CUDA graphs failed (RuntimeError: model: graph break in the scan); "
                               "compile=blocks failed (RuntimeError: blocks: graph break in the scan); measured with compile=off")
        with pytest.raises(RuntimeError, match="graph break"):  # DiT rows do not fall back: a failure is the row's error
            gpu_speed.step_row("dit", "S", "random", 2, 4, 8, "cpu", False, "blocks", 1, 0)
    finally:
        gpu_speed._routing_help.cache_clear()


def test_todays_routing_and_trainer_compile_flags():
    gpu_speed._routing_help.cache_clear()
    modes, _ = gpu_speed.routing_compile_modes()
    assert "blocks" in modes  # the real train.bench.routing offers per-block compile, in one form or the other
    assert gpu_speed.trainer_compile_overrides("blocks") in (["trainer.compile=true"], ["trainer.compile=blocks"])
    assert gpu_speed.trainer_compile_overrides("off") in (["trainer.compile=false"], ["trainer.compile=off"])


@pytest.mark.parametrize("argv, says", [
    (["--dry-run", "--budget-s", "soon"], "'soon' is not a number"),
    (["--dry-run", "--budget-s", "0"], "out of range"),
    (["--dry-run", "--compile", "fast"], "invalid choice: 'fast'"),
    (["--dry-run", "--sections", "everything"], "invalid choice: 'everything'"),
    (["--dry-run", "--repeats", "0"], "out of range"),
    (["--dry-run", "--device", "tpu"], "--device"),
    (["--device", "cpu"], "--device cpu is not a GPU"),
    (["--dry-run", "--out", __file__], "is a file, not a folder"),
])
def test_bad_arguments_get_one_sentence(capsys, argv, says):
    with pytest.raises(SystemExit) as stop:
        gpu.main(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and says in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs the full check")
def test_the_full_check_without_a_gpu_says_how_to_dry_run(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu.main([])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "--dry-run" in err and len(err.splitlines()) == 1


def test_the_bare_step_the_trainer_measured_is_the_dit_b_tread_row():
    """With `--sections trainer` alone the trainer measures the bare DiT-B/2 TREAD step itself: the report shows it as
    that row and decides that row's goal with it (the H100 run of 48e6353 printed it but left the goal 'not measured')."""
    bare = {"backbone": "dit", "preset": "B", "tokens": 256, "channels": 3, "policy": "random", "route": "r2->8 x0.5",
            "batch": 128, "compile": "model", "cuda_graphs": False, "ms_unrouted": 53.4, "ms_routed": 39.5, "ideal": 1.43,
            "measured": 1.35, "efficiency": 0.95, "mfu_unrouted": 0.337, "mfu_routed": 0.319, "compile_s": 68.0, "graphs": 2}
    row = {"section": "trainer", "command": "python -m train ...", "trainer_images_per_s": 3243.0, "bare_images_per_s": 3237.0,
           "ratio": 1.0, "bare_step": {"section": "dit-B-tread", **bare}}
    sections = [{"name": "trainer", "title": "python -m train against the bare step", "kind": "trainer", "status": "measured",
                 "seconds": 148.0, "note": "bare step measured here", "records": [row]}]
    decided = {g["goal"]: g for g in gpu_report.goals(sections, dry_run=False)}
    assert decided["DiT-B/2 TREAD: routed efficiency >= 0.9"] == {"goal": "DiT-B/2 TREAD: routed efficiency >= 0.9",
                                                                  "measured": "0.95", "met": True}
    assert decided["DiT-XL/2 TREAD: routed efficiency >= 0.9"]["met"] is None
    report = {"environment": {"device": "H100", "torch": "2.11", "cuda": "13.0", "triton": "3.6", "python": "3.12", "commit": "x"},
              "sections": sections, "goals": list(decided.values()), "dry_run": False, "command": "python -m train.bench.gpu",
              "date": "today", "bf16": True, "compile": "model", "cuda_graphs": False, "budget_s": 200.0, "seconds": 148.0}
    md = gpu_report.markdown(report)
    assert "## Training steps (train.bench.routing)" in md and "| dit-B-tread | dit-B/2 (256 tokens, 3 ch) | random r2->8 x0.5 |" in md
    assert "| `python -m train ...` | 3243 | 3237 | 1.00 |" in md
