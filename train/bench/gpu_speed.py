"""Speed sections of `python -m train.bench.gpu`: routed training steps (through train.bench.routing itself), the
two kernels at their reference shapes against the memory roofline, and `python -m train` against the bare step.

The compile mode is passed through to train.bench.routing and to the trainer in whatever form they take: read
from `train.bench.routing --help` and from the trainer's schema, so the modes `off | blocks | model` are used
as soon as those commands accept them, and today's switch (`--compile`, `trainer.compile=true`) until then.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import statistics
import time
from unittest import mock
from collections.abc import Iterator
import tempfile
from pathlib import Path

import torch

from train.bench import routing
from train.bench.gpu_profile import profile_call
from train.bench.spread import ROUNDS, interleaved_rounds, spread
from train.bench.timing import card_bandwidth
from train.bench.wkv import ideal_bytes as wkv_ideal_bytes

SWITCH = ("off", "blocks")  # what a store_true `--compile` (one per-block compile) can express


@functools.cache
def _routing_help() -> str:
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        routing.main(["--help"])
    return text.getvalue()


def routing_compile_modes() -> tuple[tuple[str, ...], bool]:
    """(modes, takes_value): the compile modes train.bench.routing accepts, read from its --help, and whether
    `--compile` takes the mode as its value (else it is the older per-block switch)."""
    line = re.search(r"--compile(?: \[?(\{[^}]*\}|[A-Z_]+))?", _routing_help())
    if line is None:
        return ("off",), False
    if line.group(1) is None:
        return SWITCH, False
    if line.group(1).startswith("{"):
        return tuple(line.group(1).strip("{}").split(",")), True
    return ("off", "blocks", "model"), True  # a free-form value (a metavar): the modes issue 37 names


def routing_offers_cuda_graphs() -> bool:
    return "--cuda-graphs" in _routing_help()


def trainer_offers_cuda_graphs() -> bool:
    from train.schema.trainer import TrainerConfig

    return "cuda_graphs" in TrainerConfig.__dataclass_fields__


def best_compile_mode() -> str:
    """Whole-model compile where train.bench.routing offers it, else per-block."""
    modes, _ = routing_compile_modes()
    return next(m for m in ("model", "blocks", "off") if m in modes)


def routing_compile_argv(mode: str, cuda_graphs: bool = False) -> list[str]:
    """The flags that ask train.bench.routing for `mode`; ValueError when it does not offer that mode."""
    modes, takes_value = routing_compile_modes()
    if mode not in modes:
        raise ValueError(f"train.bench.routing offers compile modes {', '.join(modes)}, not {mode}")
    if cuda_graphs and not routing_offers_cuda_graphs():
        raise ValueError("train.bench.routing has no --cuda-graphs in this version")
    graphs = ["--cuda-graphs"] if cuda_graphs else []
    if takes_value:
        return ["--compile", mode, *graphs]
    return (["--compile"] if mode == "blocks" else []) + graphs


def trainer_compile_overrides(mode: str, cuda_graphs: bool = False) -> list[str]:
    """`trainer.compile=...` for `mode` (the mode itself once the key takes modes, else true / false), and
    `trainer.cuda_graphs=true` when asked; ValueError where this version's trainer cannot express them."""
    from train.schema.trainer import TrainerConfig

    if cuda_graphs and not trainer_offers_cuda_graphs():
        raise ValueError("the trainer has no trainer.cuda_graphs in this version")
    graphs = ["trainer.cuda_graphs=true"] if cuda_graphs else []
    if not isinstance(TrainerConfig.__dataclass_fields__["compile"].default, bool):
        return [f"trainer.compile={mode}", *graphs]
    if mode not in SWITCH:
        raise ValueError(f"trainer.compile is a switch (per-block compile) in this version, so it cannot run compile={mode}")
    return [f"trainer.compile={str(mode == 'blocks').lower()}", *graphs]


def step_row(backbone: str, preset: str, policy: str, batch: int, channels: int, size: int, device: str, bf16: bool,
             compile_mode: str, repeats: int, warmup: int, cuda_graphs: bool = False, fall_back: bool = False,
             regions: bool = False, rounds: int = ROUNDS, profile: bool = False) -> dict:
    """One row of train.bench.routing (its own measure(): FLOPs, ms, efficiency, MFU, each round's numbers and the
    first steps' time), with what was asked. `fall_back`: when the compiled run fails, try the next lesser mode
    (model, then blocks, then eager), and say why in `note` ("compiled where they compile"). `regions`:
    --compile-regions with the first try. `profile`: one unrouted and one routed step profiled after the timing."""
    argv = ["--backbone", backbone, "--presets", preset, "--policy", policy, "--batch", str(batch), "--channels", str(channels),
            "--input-size", str(size), "--patch", "2", "--device", device, "--repeats", str(repeats), "--warmup", str(warmup),
            "--rounds", str(rounds)]
    argv += (["--bf16"] if bf16 else []) + (["--profile"] if profile else [])
    modes = ("model", "blocks", "off")
    tries = [(compile_mode, cuda_graphs)] + ([(m, False) for m in modes[modes.index(compile_mode) + 1:]] if fall_back else [])
    notes = []
    for mode, graphs in tries:
        regional = regions and (mode, graphs) == tries[0]
        try:
            (row,) = _routing(argv + routing_compile_argv(mode, graphs) + (["--compile-regions"] if regional else []))
            break
        except Exception as err:  # noqa: BLE001 - a family that does not compile is measured a lesser way, with the reason
            if (mode, graphs) == tries[-1]:
                raise
            notes.append(f"compile={mode}{' with regions' if regional else ''}{' with CUDA graphs' if graphs else ''} failed ({type(err).__name__}: {first_line(err)})")
            torch._dynamo.reset()  # the failed attempt's graphs must not be reused by the next one
    return {**row, "backbone": backbone, "policy": policy, "channels": channels, "bf16": bf16, "compile": mode, "cuda_graphs": graphs,
            "regions": regional,
            "note": "; ".join(notes + ([f"measured with compile={mode}"] if notes else []))}


def _routing(argv: list[str]) -> list[dict]:
    """train.bench.routing's main; its refusal of an argument (SystemExit, which no section may raise) as an error."""
    try:
        return routing.main(argv)
    except SystemExit as stop:
        raise RuntimeError(f"train.bench.routing refused its arguments (exit {stop.code}, its message is above): {' '.join(argv)}") from None


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


def scan_ideal_bytes(b: int, d: int, length: int, n: int, element: int) -> tuple[int, int]:
    """(forward, forward+backward) bytes of the selective scan if every tensor is read or written once: u, delta
    (b, d, L) and B, C (b, N, L) in the activation dtype; A (d, N), D, delta_bias (d,) in fp32; no z."""
    act, bc, small = b * d * length, b * n * length, (d * n + 2 * d) * 4
    forward = (3 * act + 2 * bc) * element + small  # read u, delta, B, C and the parameters; write y
    return forward, forward + (5 * act + 4 * bc) * element + 2 * small  # read them and dy again; write their grads


def kernel_rows(device: torch.device, scan_shape: tuple[int, ...], wkv_shape: tuple[int, ...], repeats: int, warmup: int,
                rounds: int = ROUNDS, precisions: tuple[str, ...] = ("bf16", "fp32"), short_chunks: bool = True,
                cuda_scan: bool = False, defaults: bool = True) -> Iterator[dict]:
    """Triton kernel and the chunked PyTorch op, forward and forward+backward, interleaved, with the ideal bytes
    against the card's bandwidth, one row at a time. Goals (issue 36, bf16): scan <= 0.6 ms, Bi-WKV <= 0.4 ms
    forward+backward. A last row times the scan in bf16 with 64-step chunks (TREAD_SCAN_CHUNK=64, the 1-2 warp
    configs) beside the default 256; the goal is decided by the default's row. Each row times `rounds` rounds and
    keeps them (the goal is decided on their range); `precisions`, `defaults` (the rows at the default chunk) and
    `short_chunks` choose the rows (the fp32 ones, the 64-step one and Bi-WKV in one launch, TREAD_WKV_KERNEL=fused,
    after the bf16 rows, decide no goal). `cuda_scan` times the scan's CUDA backend (TREAD_SCAN_BACKEND=cuda, compiled by load_inline on its
    first call, minutes) in place of the other rows: opt-in until a GPU has timed it, so it decides no goal yet."""
    from backbones.ops import selective_scan_triton, wkv_triton, wkv_triton_fused
    from backbones.ops.cuda_kernels import scan_fn
    from backbones.ops.wkv import bi_wkv

    from train.bench.gpu_checks import guarded, scan_inputs, wkv_inputs

    def scan(precision: str, name: str = "selective scan", primary: str = "triton") -> dict:
        inputs = {k: v for k, v in scan_inputs(b, d, length, n, device, precision).items() if k != "z"}
        inputs["delta_bias"] = torch.full((d,), -4.0, device=device)  # softplus(-4) ~ 0.018, a typical step
        goal = 0.6 if precision == "bf16" and primary == "triton" else None
        row = _time_kernel(name, precision, f"b{b} d{d} L{length} N{n}", inputs, goal,
                           lambda backend, **kw: scan_fn(**kw, delta_softplus=True, backend=backend),
                           scan_ideal_bytes(b, d, length, n, _bytes(precision)), repeats, warmup, device, rounds, primary)
        return {**row, "tuned": tuned_configs(selective_scan_triton) if primary == "triton" else {}}

    def wkv(precision: str, name: str = "Bi-WKV") -> dict:
        fused = name != "Bi-WKV"  # the one-launch kernels (TREAD_WKV_KERNEL=fused): no goal rests on them yet
        row = _time_kernel(name, precision, f"B{B} T{T} C{C}", wkv_inputs(B, T, C, device, precision),
                           0.4 if precision == "bf16" and not fused else None,
                           lambda backend, **kw: bi_wkv(**kw, backend=backend),
                           wkv_ideal_bytes(B, T, C, _bytes(precision)), repeats, warmup, device, rounds)
        return {**row, "tuned": tuned_configs(wkv_triton_fused if fused else wkv_triton)}

    b, d, length, n = scan_shape
    B, T, C = wkv_shape
    if cuda_scan:
        for precision in precisions:
            name = "selective scan, CUDA (load_inline)"
            yield guarded({"kernel": name, "precision": precision, "shape": f"b{b} d{d} L{length} N{n}"},
                          lambda: scan(precision, name, "cuda"))
        return
    for precision in precisions if defaults else ():
        yield guarded({"kernel": "selective scan", "precision": precision, "shape": f"b{b} d{d} L{length} N{n}"},
                      lambda: scan(precision))
        yield guarded({"kernel": "Bi-WKV", "precision": precision, "shape": f"B{B} T{T} C{C}"}, lambda: wkv(precision))
    # Bi-WKV in one launch per pass beside the 3-launch default, last (its compile of two kernels, seconds each):
    # not yet timed on a GPU, so it decides no goal (docs/rwkv.md, "One launch per pass").
    fused = "Bi-WKV, one launch (TREAD_WKV_KERNEL=fused)"
    if defaults and "bf16" in precisions:
        with mock.patch.dict(os.environ, {"TREAD_WKV_KERNEL": "fused"}):
            yield guarded({"kernel": fused, "precision": "bf16", "shape": f"B{B} T{T} C{C}"}, lambda: wkv("bf16", fused))
    short = "selective scan, 64-step chunks"
    if not short_chunks:
        return
    with mock.patch.dict(os.environ, {"TREAD_SCAN_CHUNK": "64"}):
        yield guarded({"kernel": short, "precision": "bf16", "shape": f"b{b} d{d} L{length} N{n}"}, lambda: scan("bf16", short))


def tuned_configs(module) -> dict[str, dict]:
    """What each of the module's autotuned kernels picked on its latest tuning: the config, and every config's time
    (ms), so a report says how far the pick is from the rest. A kernel with one config (the interpreter's) is never
    timed by the autotuner, so it lists the config alone."""
    from triton.runtime.autotuner import Autotuner

    def name(config) -> str:
        return " ".join([*(f"{k}={v}" for k, v in config.kwargs.items()), f"warps={config.num_warps}"])

    def ms(timing) -> float:  # the autotuner keeps [median, 20th, 80th percentile] or one number
        return float(timing[0] if isinstance(timing, (list, tuple)) else timing)

    tuned = {}
    for attr, kernel in sorted(vars(module).items()):
        if isinstance(kernel, Autotuner) and getattr(kernel, "best_config", None) is not None:
            timings = getattr(kernel, "configs_timings", None) or {}
            tuned[attr] = {"picked": name(kernel.best_config), "ms": {name(c): ms(t) for c, t in timings.items()}}
    return tuned


def _bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def _time_kernel(kernel, precision, shape, inputs, goal_ms, op, ideal, repeats, warmup, device, rounds,
                 primary: str = "triton") -> dict:
    """One kernel row: the `primary` backend against the chunked PyTorch op, forward and forward+backward."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    calls = {}
    for backend in (primary, "torch"):
        def forward(backend=backend):
            with torch.no_grad():
                op(backend, **leaves)

        def both(backend=backend):
            y = op(backend, **leaves)
            # autograd.grad, not backward: no accumulation into .grad, which is not the kernel's work
            torch.autograd.grad(y, list(leaves.values()), torch.ones_like(y))

        calls[backend, "fwd"], calls[backend, "fwd+bwd"] = forward, both
    tic = time.perf_counter()
    calls[primary, "fwd+bwd"]()  # the first call: the compile (and Triton's autotuning), timed apart
    _sync(device)
    first_s = time.perf_counter() - tic
    per_round = {key: [s * 1e3 for s in v] for key, v in interleaved_rounds(calls, rounds, repeats, warmup, device).items()}
    ms = {key: statistics.median(v) for key, v in per_round.items()}
    launches = launch_profile(calls[primary, "fwd+bwd"], device)
    peak = card_bandwidth(device)
    achieved = ideal[1] / (ms[primary, "fwd+bwd"] / 1e3)
    return {"kernel": kernel, "precision": precision, "shape": shape, "ms_fwd": ms[primary, "fwd"],
            "ms_fwd_bwd": ms[primary, "fwd+bwd"], "ms_torch_fwd": ms["torch", "fwd"], "ms_torch_fwd_bwd": ms["torch", "fwd+bwd"],
            "speedup_vs_torch": ms["torch", "fwd+bwd"] / ms[primary, "fwd+bwd"], "ideal_bytes_fwd": ideal[0],
            "ideal_bytes_fwd_bwd": ideal[1], "achieved_gbps": achieved / 1e9, "peak_fraction": achieved / peak if peak else None,
            "roofline_ms": ideal[1] / peak * 1e3 if peak else None, "goal_ms": goal_ms,
            "goal_met": None if goal_ms is None else ms[primary, "fwd+bwd"] <= goal_ms, "launches": launches,
            "first_s": first_s, "rounds": {"ms_fwd": per_round[primary, "fwd"], "ms_fwd_bwd": per_round[primary, "fwd+bwd"]}}


def launch_profile(call, device: torch.device, top: int = 10) -> list[dict]:
    """Where one call's time goes: its `top` costliest kernels (train.bench.gpu_profile: device time on a GPU, the
    ops' own CPU time on a CPU), each with its calls, microseconds and kind, costliest first. The one H100 run had
    only totals, which cannot say which launch is slow."""
    return profile_call(call, device, top)["top"]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def trainer_row(preset: str, batch: int, size: int, steps: int, log_every: int, bf16: bool, compile_mode: str, cuda_graphs: bool,
                dry_run: bool, regions: bool = False) -> dict:
    """`python -m train`'s trainer on shapes with TREAD's random routing, run in this process as the command runs it
    (the config composed and checked as the command composes it, then Trainer(cfg).fit(): the same loop, logging and
    metrics file): images/s over the logged steps after the first logged one (which holds compilation and warm-up),
    from the log's wall time. In this process, not a fresh one, so the check pays no second start-up (imports, CUDA
    context) and its compiles share this process's Inductor caches; a user's process pays those before step 1, and
    no logged step after the first includes them."""
    from train.cli import precompose
    from train.files.metrics_log import read_metrics
    from train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="gpu_check_train_") as tmp:
        argv = [f"backbone.preset={preset}", "backbone.patch_size=2", "data=shapes", f"data.resolution={size}", "routing=random",
                f"trainer.batch_size={batch}", f"trainer.max_steps={steps}", f"trainer.log_every={log_every}",
                "trainer.sample_every=0", "trainer.ckpt_every=0", "trainer.log_with=none",
                f"trainer.mixed_precision={'bf16' if bf16 else 'no'}", *trainer_compile_overrides(compile_mode, cuda_graphs),
                *(["trainer.compile_regions=true"] if regions else []),
                f"run_dir={tmp}/run"]
        argv += ["trainer.cpu=true", "data.num_images=64"] if dry_run else []
        try:
            cfg = precompose("config", argv)  # checked as python -m train checks it: a bad value is one sentence, exit 2
        except SystemExit as stop:  # its refusal (one sentence, above) must not end the whole check
            raise RuntimeError(f"python -m train refused its arguments (exit {stop.code}): {' '.join(argv)}") from None
        Trainer(cfg).fit()
        records = [json.loads(line) for line, _ in read_metrics(Path(tmp) / "run" / "metrics.jsonl")]
    timed = [r for r in records if "seconds" in r]
    if len(timed) < 2:
        raise RuntimeError(f"python -m train logged {len(timed)} timed steps; the rate needs two")
    first, last = timed[0], timed[-1]
    rate = batch * (last["step"] - first["step"]) / (last["seconds"] - first["seconds"])
    # Each span between two logged steps after the first logged one is a round: its images/s.
    rounds = [batch * (b["step"] - a["step"]) / (b["seconds"] - a["seconds"]) for a, b in zip(timed, timed[1:])]
    return {"command": "python -m train " + " ".join(a for a in argv if not a.startswith("run_dir=")), "steps_timed": last["step"] - first["step"],
            "trainer_images_per_s": rate, "compile": compile_mode, "cuda_graphs": cuda_graphs, "regions": regions,
            "first_s": first["seconds"], "rounds": {"trainer_images_per_s": rounds}}
