"""`python -m train.bench.gpu`: its dry run covers every section, its budget skips and stops, its checks can fail,
and a bad argument gets one sentence. The dry run runs the kernels through Triton's interpreter (conftest.py)."""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import pytest
import torch

from train.bench import gpu, gpu_checks, gpu_profile, gpu_report, gpu_speed, spread
from train.bench.gpu_budget import PROGRESS, Section, run_sections


# The sections a cheap dry run covers in the default suite: every kind of section but the Triton ones, whose interpreted
# kernels take most of a full dry run (kernel-speed alone about 10 s of CPU); the -m slow case runs every section.
CHEAP = ("families", "attention", "dit-B-tread", "trainer", "dit-S", "mamba-S", "rwkv-S")


def test_dry_run_of_every_kind_of_section(tmp_path, capsys):
    report = gpu.main(["--dry-run", "--out", str(tmp_path / "out"), "--sections", *CHEAP])
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    md = (tmp_path / "out" / "report.md").read_text()
    assert [s["name"] for s in saved["sections"]] == list(CHEAP)
    for section in saved["sections"]:
        # A dry run has time for everything, and every section's code runs without an error.
        assert section["status"] in ("passed", "measured"), (section["name"], section["note"])
        assert section["records"], section["name"]
        assert f"{section['title']}: **{section['status']}**" in md
    for heading in ("Families on the device against the CPU", "DiT's attention on the flash kernel",
                    "Training steps (train.bench.routing)", "python -m train against the bare step"):
        assert f"## {heading}" in md
    env = saved["environment"]
    assert env["torch"] == torch.__version__ and env["triton"] and "device" in env and "commit" in env
    # DiT's attention meets flash attention's conditions at every routed shape (tiny: 16 tokens, 8 with TREAD, 4 with SPRINT).
    shapes = {r["recipe"]: r["shapes"] for s in saved["sections"] if s["name"] == "attention" for r in s["records"]}
    assert shapes == {"none": ["16 tokens x head dim 32 bfloat16"],
                      "random": ["16 tokens x head dim 32 bfloat16", "8 tokens x head dim 32 bfloat16"],
                      "sprint": ["16 tokens x head dim 32 bfloat16", "4 tokens x head dim 32 bfloat16"]}
    families = {(r["family"], r["precision"]) for s in saved["sections"] if s["name"] == "families" for r in s["records"]}
    assert families == {(f, p) for f in ("dit", "rwkv", "mamba", "diffmoe") for p in ("fp32", "bf16")}
    trainer = next(s for s in saved["sections"] if s["name"] == "trainer")
    row = trainer["records"][0]
    assert row["trainer_images_per_s"] > 0 and row["ratio"] > 0 and trainer["note"] == "bare step from the DiT-B/2 TREAD row"
    # Every speed row ran ROUNDS rounds and keeps them; the trainer's rounds are the spans between its logged steps.
    speed = [r for s in saved["sections"] if s["kind"] == "steps" for r in s["records"]]
    assert len(speed) == 4 and all(len(x) == 3 for r in speed for x in r["rounds"].values())
    assert all(r["first_s"] > 0 for r in speed) and row["first_s"] > 0
    assert len(row["rounds"]["trainer_images_per_s"]) == 3 and row["spreads"]["ratio"]["n"] == 3
    assert saved["rounds"] == 3 and "3 rounds per speed row" in md and "| goal | median | range | verdict | note |" in md
    # Tiny shapes on a CPU decide no goal, but every goal is listed (the side-by-side's too, without --tread).
    assert len(saved["goals"]) == 16 and all(g["met"] is None and g["verdict"] == "not measured" for g in saved["goals"])
    # ... though the rule reads the rounds of every goal whose rows ran, as it would on a GPU: the scan families' and
    # DiT-B/2's efficiencies and the trainer's ratio (a CPU has no peak, so no MFU).
    ruled = {g["goal"]: g["rule"] for g in saved["goals"] if g["n"]}
    assert len(ruled) == 4 and set(ruled.values()) <= {"met", "missed", "undecided"}
    assert "the rule reads " in md
    assert saved["caches"] == {} and "compile caches" not in md  # a dry run compiles nothing
    assert report["sections"][0]["records"][0]["passed"]
    out = capsys.readouterr().out
    assert "[" in out and "families:" in out and "wrote" in out  # progress lines


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path, capsys):
    """The default set as a run without --sections runs it, then the second call's sections: every section's dry run
    (the kernels through Triton's interpreter)."""
    report = gpu.main(["--dry-run", "--out", str(tmp_path / "out")])
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    md = (tmp_path / "out" / "report.md").read_text()
    # The default set: every section but the second call's and the opt-in ones, which the report names.
    assert [s["name"] for s in saved["sections"]] == [n for n in gpu.SECTION_NAMES if n not in gpu.OPT_IN + gpu.SECOND_CALL]
    assert {x["name"] for x in saved["not_run"]} == set(gpu.OPT_IN + gpu.SECOND_CALL)
    assert "Not in this run (name them with --sections): " in md
    assert "`python -m train.bench.gpu --sections dit-S mamba-S rwkv-S`" in md
    for section in saved["sections"]:
        assert section["status"] in ("passed", "measured"), (section["name"], section["note"])
        assert section["records"], section["name"]
    for heading in ("Kernels against their references", "Kernels at their reference shapes"):
        assert f"## {heading}" in md
    kernels = {(r["kernel"], r["precision"]) for s in saved["sections"] if s["name"] == "kernels" for r in s["records"]}
    assert kernels == {("selective scan (Triton)", p) for p in ("fp32", "bf16", "fp32, decay -1e5")} | {("Bi-WKV (Triton)", p) for p in ("fp32", "bf16")}
    # Every kernel row names the config each autotuned kernel it ran picked (the interpreter has one config each).
    tuned = {r["kernel"]: r["tuned"] for s in saved["sections"] if s["name"] == "kernel-speed" for r in s["records"]}
    # The 64-step chunks are kernel-speed-chunk64's, opt-in; Bi-WKV in one launch is timed beside the default.
    assert set(tuned) == {"selective scan", "Bi-WKV", "Bi-WKV, one launch (TREAD_WKV_KERNEL=fused)"}
    assert set(tuned["Bi-WKV, one launch (TREAD_WKV_KERNEL=fused)"]) == {"_fused_fwd_kernel", "_fused_bwd_kernel"}
    assert set(tuned["selective scan"]) == {"fwd_kernel", "bwd_kernel"} and len(tuned["Bi-WKV"]) >= 2
    assert all(t["picked"].startswith("BLOCK_") and t["ms"] == {} for k in tuned.values() for t in k.values())
    assert "fwd_kernel: BLOCK_D=" in md
    # And where one forward+backward's time goes, launch by launch (the CPU's ops in a dry run).
    launches = [r["launches"] for s in saved["sections"] if s["name"] == "kernel-speed" for r in s["records"]]
    assert all(rows and all(x["us"] > 0 and x["calls"] >= 1 for x in rows) for rows in launches)
    assert "Launches of one selective scan bf16 forward+backward" in md
    speed = [r for s in saved["sections"] if s["kind"] in ("steps", "kernel_speed") for r in s["records"]]
    assert speed and all(len(x) == 3 for r in speed for x in r["rounds"].values()) and all(r["first_s"] > 0 for r in speed)
    assert len(saved["goals"]) == 16 and all(g["verdict"] == "not measured" for g in saved["goals"])
    assert report["sections"][0]["records"][0]["passed"]
    second = gpu.main(["--dry-run", "--out", str(tmp_path / "second"), "--sections", *gpu.SECOND_CALL])
    assert [s["status"] for s in second["sections"]] == ["measured"] * len(gpu.SECOND_CALL)


def test_the_default_set_fits_the_default_budget_and_names_the_second_call(tmp_path):
    """Without --sections the check runs every goal's section but the scan families' steps, which do not fit beside
    them in 8 minutes by the estimates (with regions, the default); the report names the second call with its command."""
    s = gpu.Settings("cuda", False, "model", 10, 3, regions=True)
    every = {x.name: x for x in gpu.sections(s)}
    default = gpu.default_set(s)
    assert default == ["families", "attention", "dit-XL-tread", "dit-XL-sprint", "dit-B-tread", "trainer", "kernels", "kernel-speed"]
    assert sum(every[n].estimate_s for n in default) <= 480 < sum(every[n].estimate_s for n in default + list(gpu.SECOND_CALL))
    assert sum(every[n].estimate_s for n in gpu.SECOND_CALL) <= 480
    # Every goal of docs/performance.md's table has its section in one of the two calls, but the opt-in batch 128 one.
    goals = {x["goal"] for x in gpu_report.goals([], dry_run=False)}
    assert len(goals) == 16
    # Without regions the compiles are the H100's as measured: the same set needs far more than 8 minutes.
    whole = {x.name: x for x in gpu.sections(gpu.Settings("cuda", False, "model", 10, 3, regions=False))}
    assert sum(whole[n].estimate_s for n in default) > 480 and whole["dit-XL-tread"].estimate_s == 175
    # With --tread the side-by-side takes dit-XL-tread's place.
    s.tread = tmp_path
    assert "dit-XL-official" in gpu.default_set(s) and "dit-XL-tread" not in gpu.default_set(s)
    report = {"sections": [], "not_run": [{"name": n, "title": every[n].title, "estimate_s": every[n].estimate_s,
                                           "second_call": n in gpu.SECOND_CALL} for n in gpu.SECOND_CALL + ("scaling",)]}
    lines = "\n".join(gpu_report._not_run(report))
    assert "`python -m train.bench.gpu --sections dit-S mamba-S rwkv-S`" in lines and "scaling (every family's step" in lines


def test_the_check_compiles_with_regions_unless_told_not_to(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_speed, "best_compile_mode", lambda: "model")
    assert gpu.parse([]).compile_regions is True
    assert gpu.parse(["--no-compile-regions"]).compile_regions is False
    assert gpu.parse(["--dry-run"]).compile_regions is False  # the dry run compiles nothing


def test_fresh_caches_for_the_call_unless_the_environment_names_them(monkeypatch, tmp_path):
    import os

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with gpu.fresh_caches() as caches:
        assert caches == {"TORCHINDUCTOR_CACHE_DIR": "fresh", "TRITON_CACHE_DIR": str(tmp_path)}
        inductor = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert "gpu_check_caches_" in inductor and os.environ["TRITON_CACHE_DIR"] == str(tmp_path)
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and os.environ["TRITON_CACHE_DIR"] == str(tmp_path)


def test_inductors_default_folder_written_by_torch_itself_is_not_taken_for_a_given_one(monkeypatch):
    """Importing torch._dynamo writes Inductor's default folder into TORCHINDUCTOR_CACHE_DIR: that is not the user
    naming a cache, so the call still compiles in a fresh one, and the variable is as it was afterwards."""
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    cache_dir()  # what torch does when it first asks for the folder
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
    with gpu.fresh_caches() as caches:
        assert caches == {"TORCHINDUCTOR_CACHE_DIR": "fresh", "TRITON_CACHE_DIR": "fresh"}
        assert "gpu_check_caches_" in cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir() and "TRITON_CACHE_DIR" not in os.environ


def test_a_call_killed_mid_run_keeps_the_report_of_the_sections_before(tmp_path, monkeypatch):
    """The report is written after every section: a call killed from outside (a device's time limit) leaves the report
    of what it measured, naming the sections it did not reach."""

    def killed(s):
        raise KeyboardInterrupt  # what no section catches: the call ends here

    monkeypatch.setattr(gpu, "attention_checks", killed)
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--dry-run", "--sections", "families", "attention", "dit-B-tread", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "report.json").read_text())
    assert [x["name"] for x in saved["sections"]] == ["families"] and saved["sections"][0]["status"] == "passed"
    md = (tmp_path / "report.md").read_text()
    assert "- attention: **not reached**" in md and "- dit-B-tread: **not reached**" in md


@pytest.mark.parametrize("ending", [KeyboardInterrupt, RuntimeError])
def test_a_section_ended_midway_keeps_the_records_it_finished(tmp_path, monkeypatch, ending):
    """Each record is in the report as it lands: a call killed from outside mid-section (a device's time limit before
    the hard stop) keeps them, marked unfinished; a section that raises keeps them beside its error."""
    record = dict(family="dit", precision="fp32", shape="2x4x8x8", output_error=0.0, grad_error=0.0, worst_grad="w",
                  grad_norm_error=0.0, tolerance=(1e-5, 1e-5), passed=True)

    def two_then_end(*args):
        yield record
        yield {**record, "family": "rwkv"}
        raise ending("the device's time ran out")

    monkeypatch.setattr(gpu_checks, "family_checks", two_then_end)
    with contextlib.nullcontext() if ending is RuntimeError else pytest.raises(KeyboardInterrupt):
        gpu.main(["--dry-run", "--sections", "families", "--out", str(tmp_path)])
    (section,) = json.loads((tmp_path / "report.json").read_text())["sections"]
    assert [r["family"] for r in section["records"]] == ["dit", "rwkv"]
    assert section["status"] == ("error" if ending is RuntimeError else "stopped") and "2 finished records kept" in section["note"]
    assert "| rwkv | fp32 |" in (tmp_path / "report.md").read_text()


def test_the_in_process_trainer_refusing_its_config_is_an_error_not_an_exit(capsys):
    """The trainer runs in the check's process: its config refusal (one sentence and exit 2 from python -m train) must
    become the section's error, not end the whole check."""
    with pytest.raises(RuntimeError, match=r"python -m train refused its arguments \(exit 2\)"):
        gpu_speed.trainer_row("XXL", 2, 8, 4, 2, False, "off", False, dry_run=True)
    assert "backbone.preset" in capsys.readouterr().err


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
            "measured": 1.35, "efficiency": 0.95, "mfu_unrouted": 0.337, "mfu_routed": 0.319, "compile_s": 68.0, "graphs": 2,
            "rounds": {"efficiency": [0.94, 0.95, 0.96]}}
    row = {"section": "trainer", "command": "python -m train ...", "trainer_images_per_s": 3243.0, "bare_images_per_s": 3237.0,
           "ratio": 1.0, "bare_step": {"section": "dit-B-tread", **bare}}
    sections = [{"name": "trainer", "title": "python -m train against the bare step", "kind": "trainer", "status": "measured",
                 "seconds": 148.0, "note": "bare step measured here", "records": [row]}]
    decided = {g["goal"]: g for g in gpu_report.goals(sections, dry_run=False)}
    b_tread = decided["DiT-B/2 TREAD: routed efficiency >= 0.9"]
    assert (b_tread["measured"], b_tread["range"], b_tread["verdict"], b_tread["met"]) == ("0.95", "0.94-0.96", "met", True)
    assert decided["DiT-XL/2 TREAD: routed efficiency >= 0.9"]["verdict"] == "not measured"
    report = {"environment": {"device": "H100", "torch": "2.11", "cuda": "13.0", "triton": "3.6", "python": "3.12", "commit": "x"},
              "sections": sections, "goals": list(decided.values()), "dry_run": False, "command": "python -m train.bench.gpu",
              "date": "today", "bf16": True, "compile": "model", "cuda_graphs": False, "budget_s": 200.0, "seconds": 148.0}
    md = gpu_report.markdown(report)
    assert "## Training steps (train.bench.routing)" in md and "| dit-B-tread | dit-B/2 (256 tokens, 3 ch) | random r2->8 x0.5 |" in md
    assert "| `python -m train ...` | 3243 | 3237 | 1.00 |" in md


def _goal(report_goals: list[dict], start: str) -> dict:
    (g,) = [g for g in report_goals if g["goal"].startswith(start)]
    return g


def _xl_row(efficiency: list[float], mfu_routed: list[float]) -> dict:
    """A fake DiT-XL/2 TREAD row: its rounds as train.bench.routing keeps them."""
    ms = [125.0, 126.0, 124.0]
    return {"section": "dit-XL-tread", "backbone": "dit", "preset": "XL", "tokens": 256, "channels": 4, "policy": "random",
            "route": "r2->24 x0.5", "batch": 64, "compile": "model", "cuda_graphs": False, "ms_unrouted": 125.0,
            "ms_routed": 80.0, "ideal": 1.72, "measured": 1.56, "efficiency": statistics.median(efficiency),
            "mfu_unrouted": 0.37, "mfu_routed": statistics.median(mfu_routed), "compile_s": 158.0, "first_s": 158.0, "graphs": 2,
            "rounds": {"ms_unrouted": ms, "ms_routed": [80.0, 79.0, 81.0], "efficiency": efficiency,
                       "mfu_unrouted": [0.36, 0.37, 0.38], "mfu_routed": mfu_routed}}


def _report(rows: list[dict]) -> dict:
    sections = [{"name": r["section"], "title": r["section"], "kind": "steps", "status": "measured", "seconds": 1.0, "note": "",
                 "records": [r]} for r in rows]
    return {"environment": {"device": "H100", "torch": "2.11", "cuda": "13.0", "triton": "3.6", "python": "3.12", "commit": "x"},
            "sections": sections, "goals": gpu_report.goals(sections, dry_run=False), "dry_run": False,
            "command": "python -m train.bench.gpu", "date": "today", "bf16": True, "compile": "model", "cuda_graphs": False,
            "budget_s": 480.0, "seconds": 1.0, "rounds": 3}


def test_a_range_that_straddles_a_goal_is_undecided():
    """The verdict rule on a fake timing table: DiT-XL/2's efficiency rounds 0.88, 0.91, 0.93 straddle the 0.9 goal,
    its routed MFU 30-31% misses 40% in every round, its unrouted MFU meets nothing, its compile (158 s) misses."""
    report = _report([_xl_row([0.88, 0.91, 0.93], [0.30, 0.31, 0.305])])
    efficiency = _goal(report["goals"], "DiT-XL/2 TREAD: routed efficiency")
    assert (efficiency["verdict"], efficiency["met"], efficiency["measured"], efficiency["range"]) == ("undecided", None, "0.91", "0.88-0.93")
    assert _goal(report["goals"], "DiT-XL/2 TREAD, batch 64: routed MFU")["verdict"] == "missed"
    assert _goal(report["goals"], "DiT-XL/2 TREAD: whole-model compile")["verdict"] == "missed"
    assert _goal(report["goals"], "DiT-XL/2 SPRINT")["verdict"] == "not measured"
    md = gpu_report.markdown(report)
    assert "| DiT-XL/2 TREAD: routed efficiency >= 0.9 | 0.91 | 0.88-0.93 (3 rounds) | *undecided* |  |" in md
    assert "| DiT-XL/2 TREAD, batch 64: routed MFU >= 40% | 30.5% | 30.0%-31.0% (3 rounds) | **missed** |" in md
    # The steps table shows each cell's median and range.
    assert "| 125.0 (124.0-126.0) | 80.0 (79.0-81.0) |" in md and "| 0.91 (0.88-0.93) |" in md
    # The whole range above the goal: met; fewer rounds than three: undecided whatever they read.
    met = _report([_xl_row([0.92, 0.95, 0.93], [0.41, 0.42, 0.43])])["goals"]
    assert _goal(met, "DiT-XL/2 TREAD: routed efficiency")["verdict"] == "met"
    assert _goal(met, "DiT-XL/2 TREAD, batch 64: routed MFU")["verdict"] == "met"
    few = _xl_row([0.95], [0.45])
    few["rounds"] = {"efficiency": [0.95], "mfu_routed": [0.45]}
    short = _goal(_report([few])["goals"], "DiT-XL/2 TREAD: routed efficiency")
    assert short["verdict"] == "undecided" and short["note"] == "1 round(s), fewer than 3"


def test_the_verdict_rule_and_ranges():
    assert spread.verdict(0.91, 0.95, 0.9) == "met" and spread.verdict(0.80, 0.89, 0.9) == "missed"
    assert spread.verdict(0.89, 0.91, 0.9) == "undecided" and spread.verdict(None, None, 0.9) == "not measured"
    assert spread.verdict(0.70, 0.79, 0.8, at_most=True) == "met" and spread.verdict(0.79, 0.81, 0.8, at_most=True) == "undecided"
    assert spread.spread([3.0, 1.0, 2.0, None]) == {"median": 2.0, "low": 1.0, "high": 3.0, "n": 3}
    # Measured apart: the ratio's range pairs the extremes.
    assert spread.ratio_range([90.0, 100.0], [100.0, 110.0]) == pytest.approx(
        {"median": 95.0 / 105.0, "low": 90.0 / 110.0, "high": 1.0, "n": 2})


def test_rounds_interleave_and_warm_up_once():
    calls: list[str] = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    out = spread.interleaved_rounds(fns, rounds=3, repeats=2, warmup=1, device="cpu")
    assert [len(v) for v in out.values()] == [3, 3] and all(s >= 0 for v in out.values() for s in v)
    assert calls == ["a", "b"] * (1 + 3 * 2)  # one warm-up round, then 3 rounds of 2 repeats, alternating


def test_an_unfair_side_by_side_decides_nothing():
    row = {"section": "dit-XL-official", "ratio_routed": 0.75, "rounds": {"ratio_routed": [0.74, 0.75, 0.76]}, "fair": False,
           "fairness": "routing saved the official side 8% of its step where its FLOPs predict 42% (less than 20%)"}
    sections = [{"name": "dit-XL-official", "status": "measured", "records": [row]}]
    g = _goal(gpu_report.goals(sections, dry_run=False), "DiT-XL/2 TREAD beside CompVis/tread's DiT")
    assert g["verdict"] == "undecided" and g["note"].startswith("reported, not decided: routing saved the official side 8%")
    row["fair"] = True
    assert _goal(gpu_report.goals(sections, dry_run=False), "DiT-XL/2 TREAD beside")["verdict"] == "met"


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("ampere_sgemm_128x64_tn", "matmul fp32"),
    ("cutlass_80_tensorop_s1688gemm_tf32_256x128_16x3_tn_align4", "matmul fp32"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<72, 128, 64, 4>>", "attention"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", "attention"),
    ("triton_per_fused_native_layer_norm_0", "norm"),
    ("void at::native::index_elementwise_kernel<128, 4>", "gather/scatter"),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 4>", "gather/scatter"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_poi_fused_add_mul_silu_3", "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "other"),
])
def test_profiled_kernels_are_sorted_into_kinds(name, kind):
    assert gpu_profile.kind_of(name) == kind


def test_profile_adds_each_steps_launches_to_its_row(tmp_path):
    report = gpu.main(["--dry-run", "--sections", "dit-S", "--profile", "--out", str(tmp_path / "out")])
    (row,) = report["sections"][0]["records"]
    assert set(row["profile"]) == {"unrouted", "routed"} and report["profile"]
    for prof in row["profile"].values():
        assert prof["top"] and prof["launches"] > 0 and sum(prof["shares"].values()) == pytest.approx(1.0)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "dit-S, one routed step (torch.profiler): " in md and "dit-S, one unrouted step (torch.profiler): " in md


def test_what_keeps_an_attention_call_off_the_flash_kernel():
    q = torch.randn(2, 4, 16, 72, dtype=torch.bfloat16)
    assert gpu_checks.flash_blockers(q, q, q) == []
    # The fp32 block after a route (routing.fp32_after_route, the official forward's): no flash kernel for fp32.
    assert gpu_checks.flash_blockers(q.float(), q.float(), q.float()) == [
        "dtypes torch.float32, torch.float32, torch.float32 (flash takes one of fp16, bf16)"]
    odd = torch.randn(2, 4, 16, 36, dtype=torch.bfloat16)
    assert gpu_checks.flash_blockers(odd, odd, odd) == ["head dim 36 (flash takes multiples of 8 up to 256)"]
    strided = torch.randn(2, 4, 72, 16, dtype=torch.bfloat16).transpose(-1, -2)
    assert gpu_checks.flash_blockers(strided, q, q, torch.ones(16, 16, dtype=torch.bool)) == [
        "an attention mask", "a last dimension that is not contiguous"]


def test_the_attention_check_sees_the_fp32_block_after_a_route(monkeypatch):
    from train.bench import routing

    pair = routing.routed_pair

    def fp32_after_route(*args, **kwargs):
        net, router = pair(*args, **kwargs)
        router.fp32_after_route = True
        return net, router

    monkeypatch.setattr(routing, "routed_pair", fp32_after_route)
    none, tread, _ = gpu_checks.attention_checks(torch.device("cpu"), "tiny", 8, 2)
    assert none["passed"] and not tread["passed"]
    assert tread["blockers"] == ["16 tokens x head dim 32 float32: dtypes torch.float32, torch.float32, torch.float32 "
                                 "(flash takes one of fp16, bf16)"]


def test_the_cuda_scan_row_is_opt_in_and_needs_cuda(tmp_path):
    # kernel-speed-cuda compiles issue 46's CUDA scan on its first call (minutes), so no default run pays for it; without
    # a GPU its row records why it could not run instead of stopping the check.
    assert "kernel-speed-cuda" in gpu.OPT_IN
    gpu.main(["--dry-run", "--sections", "kernel-speed-cuda", "--out", str(tmp_path / "out")])
    (section,) = json.loads((tmp_path / "out" / "report.json").read_text())["sections"]
    (row,) = section["records"]
    assert row["kernel"] == "selective scan, CUDA (load_inline)" and "needs CUDA tensors" in row["error"]
