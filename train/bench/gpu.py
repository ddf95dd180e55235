"""The whole GPU check in one command: every goal of docs/performance.md, each decided on repeated rounds.

    python -m train.bench.gpu --out docs/gpu/h100-2026-11-27              # the default set: every goal but the scan families' steps (~460 s)
    python -m train.bench.gpu --out ... --sections dit-S mamba-S rwkv-S    # the second call: the scan families' steps (~280 s)
    python -m train.bench.gpu --sections families attention kernels --out runs/gpu    # correctness only
    python -m train.bench.gpu --dry-run --out runs/gpu-dry                            # the default set at tiny shapes on the CPU

The speed rows compile with regions (--compile-regions, the default with --compile model: each distinct block
compiled once), in one fresh Inductor and Triton cache for the whole call. Sections run in order of importance, each
started only if its estimated time still fits the budget (--budget-s); one that does not fit is skipped with a line
saying so, and one that runs far past its estimate or the budget is stopped (train/bench/gpu_budget.py). A failed
check or a section that raises is a line of the report, and the run goes on. Every speed row times --rounds rounds
(at least 3) and a goal is met or missed only when the whole range is (train/bench/spread.py); --profile adds where
each step's time goes (train/bench/gpu_profile.py). It writes report.md and report.json into --out: device,
versions, commit, every check and row, what was skipped or left out (the second call and the opt-in sections), and
the goals the rows decide. The training steps are train.bench.routing's own rows, in the compile mode given
(default: the best it offers). On a machine without a GPU the dry run takes the kernels
through Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

# Triton reads TRITON_INTERPRET when it is first imported (torch imports it): a dry run without a GPU chooses the
# interpreter before anything else is imported. In-process callers set it themselves (tests/conftest.py does).
if __name__ == "__main__" and "--dry-run" in sys.argv[1:] and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from train.bench.gpu_budget import PROGRESS, Section, run_sections
from train.bench.spread import ROUNDS, ratio_range
from routing import ConfigError
from train.cli import ArgumentParser, bounded, check_scan_switches, device as device_type, output_folder, refuse


@dataclass
class Settings:
    """What every section reads: the device, the mode, and the full or the dry-run shapes."""

    device: str
    dry_run: bool
    compile: str
    repeats: int
    warmup: int
    cuda_graphs: bool = False
    bf16: bool = True
    regions: bool = False  # --compile-regions
    rounds: int = ROUNDS  # rounds of interleaved repeats per speed row (--rounds)
    profile: bool = False  # --profile: each training-step row also profiles one unrouted and one routed step
    steps: dict = field(default_factory=dict)  # (backbone, preset, policy, batch, channels) -> measured row
    tread: Path | None = None  # a local copy of CompVis/tread's dit.py and routing_module.py (--tread)

    def preset(self, full: str) -> str:
        return "tiny" if self.dry_run else full

    def batch(self, full: int) -> int:
        return 2 if self.dry_run else full

    @property
    def size(self) -> int:
        return 8 if self.dry_run else 32  # latent side: 32 with patch 2 gives 256 tokens


def kernel_checks(s: Settings) -> dict:
    from train.bench.gpu_checks import kernel_checks as checks

    records = checks(_kernel_device(s), (1, 4, 8, 4) if s.dry_run else (2, 64, 256, 16), (1, 8, 4) if s.dry_run else (2, 256, 64))
    return _checked(PROGRESS.collect(records))


def family_checks(s: Settings) -> dict:
    from train.bench.gpu_checks import family_checks as checks

    out = _checked(PROGRESS.collect(checks(_device(s), "tiny", s.size, s.batch(4), 2 if s.dry_run else None)))
    if _device(s).type == "cpu":
        out["note"] += " (both sides on the CPU: this compares nothing but runs the code)"
    return out


def attention_checks(s: Settings) -> dict:
    """DiT-XL/2's attention on SDPA's flash path at every shape its routes make (head dim 72), eager, batch 4."""
    from train.bench.gpu_checks import attention_checks as checks

    return _checked(PROGRESS.collect(checks(_device(s), s.preset("XL"), s.size, s.batch(4))))


def kernel_speed(s: Settings, precision: str = "bf16", cuda_scan: bool = False, short_chunks: bool = False) -> dict:
    """The kernels in bf16 (their goals); or in fp32 (opt-in, no goal); or the scan's CUDA backend alone (opt-in until
    a GPU has timed it); `short_chunks`: the scan's 64-step chunks alone (opt-in: no goal rests on it, and its configs
    are compiles of their own)."""
    from train.bench.gpu_speed import kernel_rows

    scan, wkv = ((1, 4, 8, 4), (1, 8, 4)) if s.dry_run else ((64, 768, 256, 16), (64, 256, 384))
    rows = PROGRESS.collect(kernel_rows(_kernel_device(s), scan, wkv, *_repeats(s, 20, 5), rounds=s.rounds, precisions=(precision,),
                                        short_chunks=short_chunks, cuda_scan=cuda_scan, defaults=not short_chunks))
    for row in rows if s.dry_run else []:
        row["goal_met"] = None  # tiny shapes decide no goal
    broken = [r for r in rows if "error" in r]
    return {"status": "error" if len(broken) == len(rows) else "measured", "records": rows,
            "note": f"{len(broken)} of {len(rows)} rows failed" if broken else ""}


def step(s: Settings, backbone: str, preset: str, policy: str, batch: int, channels: int = 4, regions: bool | None = None) -> dict:
    """One row of train.bench.routing in the check's mode; `regions` overrides the check's --compile-regions (the
    opt-in dit-XL-whole row)."""
    from train.bench.gpu_speed import step_row

    row = step_row(backbone, s.preset(preset), policy, s.batch(batch), channels, s.size, str(_device(s)), s.bf16, s.compile,
                   *_repeats(s, s.repeats, s.warmup), cuda_graphs=s.cuda_graphs, fall_back=backbone in ("rwkv", "mamba"),
                   regions=s.regions if regions is None else regions, rounds=s.rounds, profile=s.profile)
    if regions is None:  # a row in the check's own mode: the trainer may reuse it as its bare step
        s.steps[backbone, preset, policy, batch, channels] = row
    return {"status": "measured", "records": [row], "note": row["note"]}


def trainer(s: Settings) -> dict:
    """python -m train against the bare routed step at the same shape (DiT-B/2, 32x32x3 shapes, batch 128)."""
    from train.bench.gpu_speed import trainer_row

    batch = s.batch(128)
    row = trainer_row(s.preset("B"), batch, s.size, 8 if s.dry_run else 60, 2 if s.dry_run else 10, s.bf16, s.compile,
                      s.cuda_graphs, s.dry_run, regions=s.regions)
    bare = s.steps.get(("dit", "B", "random", 128, 3))
    note = "bare step from the DiT-B/2 TREAD row"
    if bare is None:
        bare, note = step(s, "dit", "B", "random", 128, channels=3)["records"][0], "bare step measured here"
        # It is the dit-B-tread row, measured: the report shows it and decides that row's goal with it.
        row["bare_step"] = {"section": "dit-B-tread", **bare}
    row.update(bare_ms=bare["ms_routed"], bare_images_per_s=batch / (bare["ms_routed"] / 1e3))
    row["ratio"] = row["trainer_images_per_s"] / row["bare_images_per_s"]
    # Measured apart (two processes), so the ratio's range pairs the extremes of both sides' rounds.
    bare_rates = [batch / (ms / 1e3) for ms in bare.get("rounds", {}).get("ms_routed", [bare["ms_routed"]])]
    row["spreads"] = {"ratio": ratio_range(row["rounds"]["trainer_images_per_s"], bare_rates)}
    return {"status": "measured", "records": [row], "note": note}


def scaling_curve(s: Settings) -> dict:
    """The cost curve (train.bench.scaling): every family and recipe from 256 to 16,384 tokens at S and B width, the
    batch keeping 16,384 tokens per step; the dry run steps each family's recipes once at its tiny shape."""
    from train.bench import scaling
    from train.bench.routing import peak_tflops

    if s.dry_run:
        rows = PROGRESS.collect(scaling.dry_run(scaling.FAMILIES, (s.size // scaling.PATCH) ** 2, progress=lambda line: None))
    else:
        groups = scaling.grid(scaling.FAMILIES, scaling.WIDTHS, scaling.TOKENS, scaling.TOKENS_PER_STEP)
        rows = PROGRESS.collect(scaling.timed_rows(groups, _device(s), *_repeats(s, s.repeats, s.warmup), peak_tflops(_device(s), None)))
    misfits = sum(not r["fits"] for r in rows)
    return {"status": "measured", "records": rows,
            "note": f"{len(rows)} cells, {misfits} do not fit (rows in report.json; python -m train.bench.scaling plots them)"}


def official(s: Settings) -> dict:
    """DiT-XL/2 TREAD beside CompVis/tread's DiT in one run (train.bench.official), from the copy --tread names."""
    from train.bench.official import main as side_by_side

    argv = ["--tread", str(s.tread), "--presets", s.preset("XL"), "--batch", str(s.batch(64)), "--input-size", str(s.size),
            "--device", str(_device(s)), "--compile", s.compile, "--repeats", str(_repeats(s, s.repeats, s.warmup)[0]),
            "--warmup", str(_repeats(s, s.repeats, s.warmup)[1]), "--rounds", str(s.rounds)]
    argv += (["--bf16"] if s.bf16 else []) + (["--cuda-graphs"] if s.cuda_graphs else []) + (["--compile-regions"] if s.regions else [])
    argv += ["--profile"] if s.profile else []
    try:
        (row,) = side_by_side(argv)
    except SystemExit as stop:  # its refusal (the message is above) must not end the whole check
        raise RuntimeError(f"train.bench.official refused its arguments (exit {stop.code}): {' '.join(argv)}") from None
    return {"status": "measured", "records": [row], "note": ""}


# Where the estimates of sections() come from. Measured on one H100 (docs/reports/2026-11-26-h100-gpu-check.md): each
# section's time and its rows' first steps (the compile), from docs/gpu/h100-2026-11-26b and -c, all with compile=model
# and no regions. Regions are not measured on a GPU yet, so their saving is a CPU proxy: the compile time with
# --compile-regions over the plain whole-model compile, train.bench.routing's first steps less their stepping, on the
# 2-core development CPU (inductor's C++ backend; docs/routing.md, "Compiling the routed step"), applied to the H100's
# compile times. The GPU's Inductor writes Triton, not C++, and there the scan families' first steps also autotune their
# Triton kernels, which regions do not shorten: so these are guesses grounded in those numbers, to be corrected from
# report.json after a run.
REGIONS_XL = 66 / 142  # DiT-XL/2 (28 blocks): 90 s with regions, 166 s without, each less ~24 s of stepping
REGIONS_B = 52 / 72  # DiT-B/2 (12 blocks): 59 s and 79 s, less ~7 s
# The S rows, 2026-11-27 on a loaded CPU, so the whole process's CPU time (compile workers included), one run each
# (docs/reports/2026-11-27-gpu-check-budget.md): DiT-S/2 92.6 s with regions against 127.9 s, RWKV-S/2 118.2 against
# 200.5, Mamba-S/2 143.6 against 197.3 (their scans custom ops there too, as on the GPU).
REGIONS_S = 92.6 / 127.9
REGIONS_RWKV = 118.2 / 200.5
REGIONS_MAMBA = 143.6 / 197.3


def compiled(s: Settings, compile_s: float, ratio: float, rest_s: float) -> float:
    """A section's estimate: the H100's measured compile time, scaled by the CPU's regions ratio when the check
    compiles with regions, plus the rest of the section (building, FLOP counts, timing). A dry run, which compiles
    nothing, reports the estimates of the GPU run it stands for: with regions, the default."""
    return round(compile_s * (ratio if s.regions or s.dry_run else 1.0) + rest_s)


def sections(s: Settings) -> list[Section]:
    """Every section, the default set first in order of importance, with its estimated time on one H100 (compiles
    included, three rounds of timing; the sources are above each estimate).

    The default set (no --sections) is the correctness checks, the DiT goals, the trainer and the scan kernels' goals:
    about 460 s with regions (the check's default), so the default budget of 480 s runs all of it; with --tread the
    side-by-side takes dit-XL-tread's place and about 50 s more. The scan families' steps (dit-S, mamba-S, rwkv-S:
    about 280 s) do not fit beside them: they are the second call (SECOND_CALL), and the report names it. The rest is
    opt-in (OPT_IN): no goal rests on them alone."""
    # h100-2026-11-26c: 214 s, of it our two whole-model graphs 158 s and the official blocks' compile 31.6 s; three
    # rounds of its four steps add about 9 s (4 x 2 x 10 steps of ~110 ms).
    official_row = [Section("dit-XL-official", "DiT-XL/2, TREAD, batch 64, beside CompVis/tread's DiT", "official",
                            compiled(s, 158, REGIONS_XL, 214 - 158 + 9), partial(official, s))] if s.tread else []
    # Not run alone yet: our side of the official row (158 s of compile) and about 17 s to build, count and time it.
    xl_tread = [Section("dit-XL-tread", "DiT-XL/2, TREAD, batch 64", "steps", compiled(s, 158, REGIONS_XL, 17),
                        partial(step, s, "dit", "XL", "random", 64))]
    return [
        # h100-2026-11-26b: 13 s.
        Section("families", "every family on the device against the CPU", "family_checks", 15, partial(family_checks, s)),
        # Not run on a GPU yet: three DiT-XL/2 builds (initialised on the CPU) and eager steps at batch 4, guessed.
        Section("attention", "DiT-XL/2's attention on the flash kernel at every routed shape", "attention_checks", 30,
                partial(attention_checks, s)),
        # With --tread the side-by-side measures our DiT-XL/2 TREAD step too (the same mode, the same route), so it
        # decides that row's goals and dit-XL-tread leaves the default set. This row's first steps decide the compile goal.
        *(official_row or xl_tread),
        # h100-2026-11-26c: 84 s, 74 s of it the first steps (its unrouted graph from Inductor's cache, after the XL row).
        Section("dit-XL-sprint", "DiT-XL/2, SPRINT, batch 64", "steps", compiled(s, 74, REGIONS_XL, 10),
                partial(step, s, "dit", "XL", "sprint", 64)),
        # h100-2026-11-26c: the bare DiT-B/2 TREAD step the trainer measured, 68 s of compile and about 7 s more.
        Section("dit-B-tread", "DiT-B/2, TREAD, batch 128, 32x32x3", "steps", compiled(s, 68, REGIONS_B, 7),
                partial(step, s, "dit", "B", "random", 128, 3)),
        # h100-2026-11-26c: 148 s with the bare step inside (75 s), so 73 s for the trainer's own process, about 34 s of
        # it compiling its one routed graph (half the bare step's two). Now in this process: its start-up (not
        # measured apart) is saved and not counted here.
        Section("trainer", "python -m train against the bare step (DiT-B/2, batch 128)", "trainer",
                compiled(s, 34, REGIONS_B, 73 - 34), partial(trainer, s)),
        # The scan kernels' checks before their speed: a wrong kernel's time means nothing. h100-2026-11-26b: 90 s.
        Section("kernels", "Triton kernels against their references", "kernel_checks", 90, partial(kernel_checks, s)),
        # h100-2026-11-26c: 78 s for the bf16 and fp32 rows of both kernels, the fp32 half now kernel-speed-fp32 (40);
        # since 0f6b02f the backward tunes 3x the configs (each a compile): guessed 20 s more than the bf16 half; and since
        # aa00813 Bi-WKV in one launch beside it (two kernels' compiles and their tuning): guessed 10 s more.
        Section("kernel-speed", "kernels at their reference shapes, bf16", "kernel_speed", 70, partial(kernel_speed, s)),
        # The second call: the scan families and their MFU reference. h100-2026-11-26b: dit-S 58 s (57 s first steps),
        # mamba-S 134 s (124 s), rwkv-S 202 s (159 s; most of the rest Bi-WKV's autotuning in the eager FLOP count).
        # Their first steps also hold the scans' Triton autotuning, which regions do not shorten: the ratio may flatter them.
        Section("dit-S", "DiT-S/2, TREAD, batch 64 (the scan families' MFU reference)", "steps", compiled(s, 57, REGIONS_S, 1),
                partial(step, s, "dit", "S", "random", 64)),
        Section("mamba-S", "Mamba-S/2, rows, batch 64", "steps", compiled(s, 124, REGIONS_MAMBA, 10),
                partial(step, s, "mamba", "S", "rows", 64)),
        Section("rwkv-S", "RWKV-S/2, rows, batch 64", "steps", compiled(s, 159, REGIONS_RWKV, 43), partial(step, s, "rwkv", "S", "rows", 64)),
        # Opt-in (--sections): no goal rests on them alone.
        *(xl_tread if official_row else []),
        # DiT-XL/2 TREAD compiled whole without regions: the compile of h100-2026-11-26c (158 s) and the MFU with fusion
        # across blocks' borders, beside the regions row; measured there as our side of the official row.
        Section("dit-XL-whole", "DiT-XL/2, TREAD, batch 64, compiled whole without regions", "steps", 158 + 17,
                partial(step, s, "dit", "XL", "random", 64, regions=False)),
        # h100-2026-11-26c: 42 s (39 s first steps).
        Section("dit-B-sprint", "DiT-B/2, SPRINT, batch 128, 32x32x3", "steps", compiled(s, 39, REGIONS_B, 3),
                partial(step, s, "dit", "B", "sprint", 128, 3)),
        Section("kernel-speed-fp32", "kernels at their reference shapes, fp32", "kernel_speed", 40, partial(kernel_speed, s, "fp32")),
        # The scan's 64-step chunks (TREAD_SCAN_CHUNK=64, 1-2 warp configs) beside the default's: not run on a GPU yet,
        # its three forward and six backward configs compiled and tuned, guessed.
        Section("kernel-speed-chunk64", "the selective scan with 64-step chunks, bf16", "kernel_speed", 40,
                partial(kernel_speed, s, "bf16", short_chunks=True)),
        # Issue 47's MFU goals also hold at the largest batch that fits: 128 is a guess for one 80 GB H100 (64 fitted in
        # the H100 runs; nothing searches for the largest). Not run yet: dit-XL-tread's compile and twice its stepping.
        Section("dit-XL-tread-b128", "DiT-XL/2, TREAD, batch 128", "steps", compiled(s, 158, REGIONS_XL, 34),
                partial(step, s, "dit", "XL", "random", 128)),
        # Issue 46's cost curve: 96 eager cells, a Triton autotune per scan length; not run on a GPU yet, guessed.
        Section("scaling", "every family's step from 256 to 16,384 tokens (train.bench.scaling)", "scaling", 600,
                partial(scaling_curve, s)),
        # Issue 46's CUDA scan (backbones/ops/selective_scan_cuda.py): load_inline compiles it on the first call (minutes on
        # 16 cores, a guess: 6-14 min on this project's 2-core CPU), then it is timed as the Triton rows are. Last: a
        # fault in a kernel never run on a GPU would leave the CUDA context unusable for every section after it.
        Section("kernel-speed-cuda", "the selective scan's CUDA backend (load_inline), bf16", "kernel_speed", 240,
                partial(kernel_speed, s, "bf16", True)),
    ]


SECTION_NAMES = ("families", "attention", "dit-XL-tread", "dit-XL-sprint", "dit-B-tread", "trainer", "kernels", "kernel-speed", "dit-S",
                 "mamba-S", "rwkv-S", "dit-XL-whole", "dit-B-sprint", "kernel-speed-fp32", "kernel-speed-chunk64", "dit-XL-tread-b128",
                 "scaling", "kernel-speed-cuda")
OPTIONAL_SECTIONS = ("dit-XL-official",)  # only with --tread
# The goals' sections that do not fit the default set's 8 minutes beside the others: the report names the call.
SECOND_CALL = ("dit-S", "mamba-S", "rwkv-S")
OPT_IN = ("dit-XL-whole", "dit-B-sprint", "kernel-speed-fp32", "kernel-speed-chunk64", "kernel-speed-cuda", "dit-XL-tread-b128",
          "scaling")  # run only when --sections names them


def default_set(s: Settings) -> list[str]:
    """The sections a run without --sections runs: every goal of docs/performance.md but the scan families' steps
    (SECOND_CALL), dit-XL-official in place of dit-XL-tread with --tread."""
    return [x.name for x in sections(s) if x.name not in OPT_IN + SECOND_CALL and not (s.tread and x.name == "dit-XL-tread")]


@contextlib.contextmanager
def fresh_caches():
    """Inductor's and Triton's on-disk caches in one fresh folder each for the whole call, unless the environment
    names them (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR). Within the call identical graphs and kernels hit them
    (SPRINT's unrouted graph after the TREAD row's, the trainer's kernels after the bare step's); no compile time or
    first call is shortened by an earlier call on the same machine, so each row's first steps are a cold compile, as
    the estimates and the compile goal assume. Yields {variable: "fresh" or the folder given}; restored afterwards."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from torch._inductor.utils import clear_caches

    with tempfile.TemporaryDirectory(prefix="gpu_check_caches_") as tmp:
        before = {name: os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        # Importing torch._dynamo writes Inductor's default folder into the variable (cache_dir_utils.cache_dir), so
        # by now the default reads as set: it counts as not given.
        given = {name: None if name == "TORCHINDUCTOR_CACHE_DIR" and folder == default_cache_dir() else folder
                 for name, folder in before.items()}
        for name, folder in given.items():
            if folder is None:
                os.environ[name] = os.path.join(tmp, name.split("_")[0].lower())
        clear_caches()  # Inductor's in-memory caches of what it read from the old folder
        try:
            yield {name: folder or "fresh" for name, folder in given.items()}
        finally:
            for name, folder in before.items():
                if folder is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = folder
            clear_caches()


def _checked(records: list[dict]) -> dict:
    failed = [r for r in records if not r["passed"]]
    return {"status": "failed" if failed else "passed", "records": records,
            "note": f"{len(failed)} of {len(records)} checks failed" if failed else f"{len(records)} checks passed"}


def _device(s: Settings):
    import torch

    return torch.device(s.device)


def _kernel_device(s: Settings):
    """The checked GPU; in a dry run a GPU when there is one and the kernels are compiled (compiled Triton takes only
    CUDA tensors), else the CPU through the interpreter."""
    import torch

    if not s.dry_run:
        return _device(s)
    return torch.device("cuda") if torch.cuda.is_available() and not _interpreted() else torch.device("cpu")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _repeats(s: Settings, repeats: int, warmup: int) -> tuple[int, int]:
    return (1, 0) if s.dry_run else (repeats, warmup)


def parse(argv: list[str] | None):
    p = ArgumentParser(prog="python -m train.bench.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=output_folder, default=Path("gpu_check"), help="folder for report.md and report.json")
    p.add_argument("--budget-s", type=bounded(float, 1, 86400, example="--budget-s 480"), default=480.0,
                   help="seconds for the whole check; sections that no longer fit are skipped (default 480)")
    p.add_argument("--device", type=device_type, default=None, help="the GPU to check (default cuda; the dry run uses the CPU)")
    p.add_argument("--compile", choices=("off", "blocks", "model"), default=None,
                   help="compile mode of the training steps (default: the best that train.bench.routing offers)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="capture the compiled steps in CUDA graphs (with --compile model; train.bench.routing --cuda-graphs, "
                        "trainer.cuda_graphs=true)")
    p.add_argument("--compile-regions", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each distinct block once and reuse it (trainer.compile_regions=true): the default with "
                        "--compile model; --no-compile-regions compiles the whole graph as one (the opt-in dit-XL-whole row does)")
    p.add_argument("--repeats", type=bounded(int, 1, 1000, example="--repeats 10"), default=10, help="timed steps per row")
    p.add_argument("--warmup", type=bounded(int, 0, 100, example="--warmup 3"), default=3, help="untimed steps per row")
    p.add_argument("--rounds", type=bounded(int, ROUNDS, 100, example=f"--rounds {ROUNDS}"), default=ROUNDS,
                   help=f"rounds of interleaved repeats per speed row; a goal is decided on their range (default and least {ROUNDS})")
    p.add_argument("--profile", action="store_true",
                   help="profile one unrouted and one routed step of every training-step row and both sides of the side-by-side "
                        "(torch.profiler: the costliest launches and the share of attention, matmuls, norms, gather/scatter)")
    p.add_argument("--tread", type=Path, default=None, metavar="DIR",
                   help="a folder with a local copy of CompVis/tread's dit.py and routing_module.py: adds DiT-XL/2 side by side "
                        "with the official code (train.bench.official)")
    p.add_argument("--sections", nargs="+", choices=SECTION_NAMES + OPTIONAL_SECTIONS, default=None, metavar="NAME",
                   help=f"run only these ({', '.join(SECTION_NAMES)}; dit-XL-official with --tread); default: every "
                        f"section but the opt-in {', '.join(OPT_IN)}")
    p.add_argument("--dry-run", action="store_true", help="every section at tiny shapes on the CPU, to check the command itself")
    args = p.parse_args(argv)
    import torch

    if args.dry_run:
        args.device = "cpu"
    elif args.device is None and not torch.cuda.is_available():
        p.error("this machine has no visible CUDA GPU; run it on one, or add --dry-run to check the command on the CPU")
    elif args.device is None:
        args.device = "cuda"
    elif not args.device.startswith("cuda"):
        p.error(f"--device {args.device} is not a GPU; the full check needs one (--dry-run checks the command on the CPU)")
    if args.tread is not None:  # refused before the run, not after the sections before it
        from train.bench.official import load_official

        try:
            load_official(args.tread)
        except ConfigError as err:
            refuse(err)
    from train.bench.gpu_speed import best_compile_mode, routing_compile_modes, routing_offers_cuda_graphs

    if args.dry_run:  # compiling on a CPU takes minutes per graph; the dry run checks the command, not speed
        args.compile, args.cuda_graphs = "off", False
    elif args.compile is None:
        args.compile = best_compile_mode()
    elif args.compile not in routing_compile_modes()[0]:
        p.error(f"--compile {args.compile} is not offered by train.bench.routing in this version "
                f"(it offers {', '.join(routing_compile_modes()[0])})")
    if args.cuda_graphs and not routing_offers_cuda_graphs():
        p.error("--cuda-graphs is not offered by train.bench.routing in this version; drop it")
    if args.dry_run:
        args.compile_regions = False
    elif args.compile_regions is None:  # the check's default: regions, where the whole-model compile makes them
        args.compile_regions = args.compile == "model"
    elif args.compile_regions and args.compile != "model":
        p.error(f"--compile-regions makes regions of the whole compiled network; use it with --compile model (not {args.compile})")
    if args.cuda_graphs and args.compile != "model":
        p.error(f"--cuda-graphs captures the whole compiled step; use it with --compile model (not {args.compile})")
    check_scan_switches(p, not args.dry_run)  # the dry run's kernels run in Triton's interpreter
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    import torch

    from train.bench import gpu_report
    from train.bench.timing import now

    s = Settings(args.device, args.dry_run, args.compile, args.repeats, args.warmup, args.cuda_graphs, tread=args.tread,
                 regions=args.compile_regions, rounds=args.rounds, profile=args.profile)
    if s.dry_run:
        torch.set_num_threads(1)  # tiny shapes gain nothing from threads, and lose much on a busy machine
    every = sections(s)
    asked = args.sections or default_set(s)
    chosen = [x for x in every if x.name in asked]
    estimate = sum(x.estimate_s for x in chosen)
    env = gpu_report.environment(torch.device(args.device))
    print(f"GPU check on {env['device']}, torch {env['torch']}, Triton {env['triton']}, commit {env['commit']}; compile={s.compile}"
          f"{' with regions' if s.regions else ''}{' with CUDA graphs' if s.cuda_graphs else ''}, {s.rounds} rounds per row"
          f"{', profiled' if s.profile else ''}, budget {args.budget_s:.0f} s{', dry run' if s.dry_run else ''}; "
          f"{len(chosen)} sections, about {estimate:.0f} s on one H100 by the estimates (H100 times, regions' CPU ratio)", flush=True)
    began = time.monotonic()
    report = {"command": "python -m train.bench.gpu " + " ".join(sys.argv[1:] if argv is None else argv), "date": now(),
              "dry_run": s.dry_run, "environment": env, "bf16": s.bf16, "compile": s.compile, "cuda_graphs": s.cuda_graphs,
              "compile_regions": s.regions, "budget_s": args.budget_s, "rounds": s.rounds, "profile": s.profile,
              "estimate_s": estimate, "asked": [x.name for x in chosen], "not_run": [{"name": x.name, "title": x.title, "estimate_s": x.estimate_s,
                                                   "second_call": x.name in SECOND_CALL} for x in every if x.name not in asked]}

    def written(results: list[dict]) -> tuple[Path, Path]:
        """The report of the sections so far: after each section, so a call killed from outside keeps them."""
        report.update(seconds=time.monotonic() - began, sections=results, goals=gpu_report.goals(results, s.dry_run))
        return gpu_report.write(args.out, report)

    with contextlib.ExitStack() as stack:
        report["caches"] = {} if s.dry_run else stack.enter_context(fresh_caches())
        results = run_sections(chosen, args.budget_s, dry_run=s.dry_run, after=written)
    md, js = written(results)
    print(f"wrote {md} and {js}", flush=True)
    return report


if __name__ == "__main__":
    main()
