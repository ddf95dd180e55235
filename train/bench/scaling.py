"""The cost curve: every family's training step from 256 to 16,384 tokens, unrouted, TREAD and SPRINT (issue 46).

    python -m train.bench.scaling                          # on a GPU: ms, MFU and peak memory of every cell
    python -m train.bench.scaling --flops-only             # anywhere: the grid's FLOP curve, no step runs
    python -m train.bench.scaling --dry-run                # each cell built at its smallest shape, one tiny step
    python -m train.bench.scaling --families dit mamba --widths S --tokens 256 4096

The grid: dit, rwkv, mamba, diffmoe x {unrouted, the family's TREAD recipe (random tokens for attention and MoE,
whole rows for the scan-order families), SPRINT} x {256, 1,024, 4,096, 16,384} tokens (latent sides 32 to 256, 4
channels, patch 2) x the S and B presets. The batch keeps the tokens per step equal (--tokens-per-step 16,384:
batch 64 at 256 tokens, 1 at 16,384), so a flat line is a cost linear in tokens and a rising one attention's
quadratic term.

On CUDA each model's three recipes share its weights, data and fused AdamW (train.bench.routing's bare step), in
bf16 autocast and eager mode (the trainer's default GPU mode), DiT's and DiffMoE's attention held to SDPA's flash
kernel; they are timed interleaved (train/bench/timing.py). A cell whose first step runs out of memory is
reported "does not fit". FLOPs are counted as the project counts them (routing.count_flops: matmuls, convolutions,
attention with the CUDA kernels' formulas) on fake tensors, so no step runs: the scans are opaque there, as their
Triton kernels are on the GPU (their element-wise work is in no FLOP count). Writes scaling_<flops|steps>.json and
a log-log plot of FLOPs or step time against tokens, one line per family and recipe, into --out.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch
from omegaconf import OmegaConf

from backbones import build_backbone
from edm import EDMPrecond
from routing import count_flops
from train.bench.routing import CONFIGS, peak_tflops
from train.bench.timing import interleaved_medians, now, peak_memory_bytes, training_step
from train.build import build_router
from train.cli import ArgumentParser, bounded, device as device_type, output_folder

FAMILIES = ("dit", "rwkv", "mamba", "diffmoe")
RECIPES = ("none", "tread", "sprint")
TREAD_POLICY = {"dit": "random", "diffmoe": "random", "rwkv": "rows", "mamba": "rows"}  # each family's usual recipe
LABELS = {"none": "unrouted", "tread": "TREAD", "sprint": "SPRINT"}
TOKENS = (256, 1024, 4096, 16384)
WIDTHS = ("S", "B")
TOKENS_PER_STEP = 16384
PATCH, CHANNELS, CLASSES = 2, 4, 1000
DRY_RUN_PRESET = "tiny"
ROOT = Path(__file__).resolve().parents[2]


def policy(family: str, recipe: str) -> str:
    """The routing config (configs/routing/<name>.yaml) of a recipe."""
    return {"none": "none", "tread": TREAD_POLICY[family], "sprint": "sprint"}[recipe]


@dataclass(frozen=True)
class Group:
    """One model of the grid: a family at a preset and a token count, and the batch that keeps tokens per step."""

    family: str
    preset: str
    tokens: int
    batch: int

    @property
    def side(self) -> int:
        """Latent side: tokens = (side / patch)^2."""
        return PATCH * math.isqrt(self.tokens)


def grid(families, presets, tokens, tokens_per_step: int) -> list[Group]:
    return [Group(f, p, t, tokens_per_step // t) for f, p, t in itertools.product(families, presets, tokens)]


def recipe_steps(group: Group, device: torch.device, draws: bool = True) -> dict[str, Callable[[], None]]:
    """A training step (forward, backward, AdamW) per recipe of one model of `group`, sharing its weights, data and
    optimizer, as train.bench.routing does for one pair. draws: each routed step draws its routes before the forward
    from a per-step generator on the device (Router.set_draws, as the trainer); off, the router draws in the forward
    (fake tensors have no generator)."""
    model = build_backbone(group.family, group.preset, input_size=group.side, in_channels=CHANNELS, patch_size=PATCH,
                           num_classes=CLASSES)
    routers = {"none": model.router}
    for recipe in RECIPES[1:]:  # SPRINT last: attach_router gives the model the fusion layers of the router it attaches
        routing = OmegaConf.load(CONFIGS / "routing" / f"{policy(group.family, recipe)}.yaml")
        routers[recipe] = build_router(routing, model)
        model.attach_router(routers[recipe])
    net = EDMPrecond(model).train()
    if device.type != "cpu":  # built on the CPU; fake tensors (group_flops) cannot be moved, and need not be
        net.to(device)
    step = training_step(net, group.batch, (CHANNELS, group.side, group.side), CLASSES, device)
    generator = torch.Generator(device=device) if draws else None
    calls = itertools.count()

    def run(recipe: str) -> Callable[[], None]:
        def route() -> None:
            model.router = routers[recipe]
            if generator is not None and recipe != "none":
                model.router.set_draws(generator.manual_seed(next(calls)), 0, group.batch)

        def call() -> None:
            route()
            step()

        def forward_backward() -> None:  # what count_flops sees of a step: AdamW's element-wise work counts nothing
            route()
            step.loss().backward()

        call.forward_backward = forward_backward
        return call

    return {recipe: run(recipe) for recipe in RECIPES}


def _bi_wkv_op(w, u, k, v, chunk_len: int = 32, backend: str = "auto"):
    """Bi-WKV as its custom op (the node torch.compile sees), whose fake implementation needs no data."""
    from backbones.ops.wkv_op import bi_wkv_op

    dtype = torch.promote_types(torch.promote_types(k.dtype, v.dtype), torch.float32)
    return bi_wkv_op(w.to(dtype), u.to(dtype), k.to(dtype), v.to(dtype), chunk_len, False)[0]


@contextlib.contextmanager
def opaque_scans() -> Iterator[None]:
    """The scans as the custom ops torch.compile sees (backbones/ops/*_op.py): on fake tensors their fake
    implementations give the shapes, where the eager paths read data (Bi-WKV's chunk length comes from w), and the
    FLOP count sees one opaque node, as it sees the Triton kernels on a GPU."""
    from backbones.ops.selective_scan_op import selective_scan_compilable

    with mock.patch("backbones.rwkv.bi_wkv", _bi_wkv_op), mock.patch("backbones.mamba.scan_fn", selective_scan_compilable):
        yield


def group_flops(group: Group, recipes=RECIPES) -> dict[str, int]:
    """FLOPs of one training step of each recipe, counted on fake tensors (shapes only: any size costs seconds).
    The forward and backward hold them all: routing.count_flops counts no element-wise op, so none of AdamW."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), opaque_scans():
        steps = recipe_steps(group, torch.device("cpu"), draws=False)
        return {recipe: count_flops(steps[recipe].forward_backward, grad=True) for recipe in recipes}


def flop_rows(groups: list[Group], progress: Callable[[str], None] = print) -> list[dict]:
    rows = []
    for group in groups:
        for recipe, flops in group_flops(group).items():
            rows.append(_row(group, recipe, flops=flops))
        progress(f"counted {group.family}-{group.preset}/2 at {group.tokens} tokens")
    return rows


def label(family: str, recipe: str) -> str:
    """"TREAD (rows)": the recipe, and for TREAD the policy that stands for it in this family."""
    return LABELS[recipe] + (f" ({TREAD_POLICY[family]})" if recipe == "tread" else "")


def _row(group: Group, recipe: str, **values) -> dict:
    return {**asdict(group), "side": group.side, "recipe": recipe, "policy": policy(group.family, recipe),
            "shape": f"{group.preset}/{PATCH} {group.tokens} tokens x {group.batch} {label(group.family, recipe)}", **values}


def step_context(group: Group, device: torch.device) -> contextlib.ExitStack:
    """The trainer's GPU mode: bf16 autocast; DiT's and DiffMoE's attention held to SDPA's flash kernel (an error,
    not a silent fallback, where flash cannot run). Off CUDA: fp32, SDPA's own choice."""
    stack = contextlib.ExitStack()
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        if group.family in ("dit", "diffmoe"):
            stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
    return stack


def time_group(group: Group, device: torch.device, repeats: int, warmup: int, flops: dict[str, int] | None,
               peak: float | None) -> list[dict]:
    """One row per recipe: ms per step (median of interleaved repeats), MFU, peak memory; "does not fit" for a
    recipe whose model or first step runs out of memory (the others are still timed)."""
    flops = flops or {}
    fits, peaks, rows = {}, {}, {}
    try:
        steps = recipe_steps(group, device)
    except torch.OutOfMemoryError:
        steps = {}
    with step_context(group, device):
        for recipe, call in steps.items():
            try:
                peaks[recipe] = first_step(call, device)
                fits[recipe] = call
            except torch.OutOfMemoryError:
                _free(device)
        try:
            seconds = interleaved_medians(fits, repeats, warmup, device) if fits else {}
        except torch.OutOfMemoryError:  # a later step ran out: which recipe's is not known, so none of them is timed
            fits = {}
            _free(device)
    for recipe in RECIPES:
        if recipe not in fits:
            rows[recipe] = _row(group, recipe, flops=flops.get(recipe), fits=False, ms=None, mfu=None, peak_memory_bytes=None)
            continue
        f, s = flops.get(recipe), seconds[recipe]
        mfu = f / s / (peak * 1e12) if f is not None and peak else None
        rows[recipe] = _row(group, recipe, flops=f, fits=True, ms=s * 1e3, mfu=mfu, peak_memory_bytes=peaks[recipe])
    del steps, fits
    _free(device)
    return list(rows.values())


def timed_rows(groups: list[Group], device: torch.device, repeats: int, warmup: int, peak: float | None,
               progress: Callable[[str], None] = print) -> Iterator[dict]:
    """Every group's rows as each group finishes (train.bench.gpu's section keeps those of a stopped run)."""
    for group in groups:
        rows = time_group(group, device, repeats, warmup, group_flops(group), peak)
        said = ", ".join(f"{r['recipe']} " + (f"{r['ms']:.1f} ms" if r["fits"] else "does not fit") for r in rows)
        progress(f"{group.family}-{group.preset}/2 at {group.tokens:,} tokens, batch {group.batch}: {said}")
        yield from rows


def first_step(call: Callable[[], None], device: torch.device) -> int | None:
    """Run a cell's first step, which shows whether it fits; on CUDA, the peak memory of the step after it, None
    elsewhere. Not the first step's: the scans' Triton autotuning runs there, with a 256 MiB buffer of its own."""
    call()
    return peak_memory_bytes(call, device) if device.type == "cuda" else None


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def dry_run(families, tokens: int, progress: Callable[[str], None] = print) -> list[dict]:
    """Each family's three recipes built at the grid's smallest token count (preset tiny, batch 1) and one step of
    each taken through the timing path (a first step, one timed) on the CPU: checks the command, measures nothing (its FLOPs are the curve's)."""
    rows = []
    for family in families:
        group = Group(family, DRY_RUN_PRESET, tokens, 1)
        rows += time_group(group, torch.device("cpu"), repeats=1, warmup=0, flops=None, peak=None)
        progress(f"dry run: {family}-{DRY_RUN_PRESET}/2 at {tokens} tokens, {', '.join(RECIPES)}: one step each")
    return rows


def header(timed: bool) -> str:
    head = "| family | width | recipe | tokens | batch | GFLOPs per step | MFLOPs per token |"
    return head + (" ms per step | MFU | peak memory GiB |" if timed else "")


def table_row(r: dict, timed: bool) -> str:
    """One cell of the grid as a markdown row (train.bench.gpu's report prints the same rows)."""
    flops = r["flops"]
    cells = [r["family"], r["preset"], label(r["family"], r["recipe"]), f"{r['tokens']:,}", str(r["batch"]),
             _f(flops, 1e-9, ".1f"), _f(flops and flops / (r["tokens"] * r["batch"]), 1e-6, ".1f")]
    if timed:
        cells += (["does not fit", "-", "-"] if not r["fits"] else
                  [_f(r["ms"], 1, ".1f"), _f(r["mfu"], 1, ".1%"), _f(r["peak_memory_bytes"], 2**-30, ".2f")])
    return "| " + " | ".join(cells) + " |"


def table(rows: list[dict], timed: bool) -> str:
    head = header(timed)
    return "\n".join([head, "|---" * (head.count("|") - 1) + "|", *(table_row(r, timed) for r in rows)])


def _f(value, scale: float, fmt: str) -> str:
    return "-" if value is None else f"{value * scale:{fmt}}"


def plot(rows: list[dict], path: Path, key: str, ylabel: str, title: str) -> None:
    """Log-log `key` against tokens, one panel per width, one line per family and recipe (colour: family; line
    style: recipe). Cells without a value (did not fit) leave a gap."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    colours = dict(zip(FAMILIES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = {"none": "-", "tread": "--", "sprint": ":"}
    markers = dict(zip(FAMILIES, "os^x"))  # DiffMoE's counts lie on DiT's: its crosses mark them over DiT's circles
    tokens = sorted({r["tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 5.5), squeeze=False, sharey=True)
    for ax, preset in zip(axes[0], presets):
        for family, recipe in itertools.product(FAMILIES, RECIPES):
            line = [r for r in rows if (r["preset"], r["family"], r["recipe"]) == (preset, family, recipe)]
            if line:
                ax.plot([r["tokens"] for r in line], [r[key] if r.get(key) is not None else float("nan") for r in line],
                        color=colours[family], linestyle=styles[recipe], marker=markers[family], markersize=5,
                        label=f"{family} {label(family, recipe)}")
        ax.set(xscale="log", yscale="log", xlabel="tokens per image", title=f"{preset} width")
        ax.set_xticks(tokens, [f"{t:,}" for t in tokens])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(FAMILIES), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out: Path, kind: str, report: dict, key: str, ylabel: str, title: str) -> tuple[Path, Path]:
    """scaling_<kind>.json and scaling_<kind>.png in `out`."""
    from train.files import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    js, png = out / f"scaling_{kind}.json", out / f"scaling_{kind}.png"
    write_atomic(js, json.dumps(report, indent=1) + "\n")
    plot(report["rows"], png, key, ylabel, title)
    return js, png


def parse(argv: list[str] | None):
    p = ArgumentParser(prog="python -m train.bench.scaling", description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--widths", nargs="+", choices=WIDTHS, default=list(WIDTHS), help="presets (S, B)")
    p.add_argument("--tokens", nargs="+", type=bounded(int, 1, 65536, example="--tokens 256 1024"), default=list(TOKENS),
                   help="tokens per image, each a square number (latent side = 2 x its root)")
    p.add_argument("--tokens-per-step", type=bounded(int, 1, 2**22, example="--tokens-per-step 16384"), default=TOKENS_PER_STEP,
                   help="tokens per training step: batch = this / tokens (a multiple of every --tokens)")
    p.add_argument("--device", type=device_type, default=None, help="the GPU to time on (default cuda when there is one)")
    p.add_argument("--repeats", type=bounded(int, 1, 1000, example="--repeats 5"), default=5, help="timed steps per cell")
    p.add_argument("--warmup", type=bounded(int, 0, 100, example="--warmup 2"), default=2, help="untimed steps per cell")
    p.add_argument("--peak-tflops", type=bounded(float, 1e-3, 1e6, example="--peak-tflops 989"), default=None,
                   help="the card's dense bf16 peak, for MFU (default: known cards)")
    p.add_argument("--flops-only", action="store_true", help="only the FLOP curve (no step runs; any machine)")
    p.add_argument("--dry-run", action="store_true", help="only the dry run: each cell at its smallest shape, one tiny step")
    p.add_argument("--out", type=output_folder, default=ROOT / "docs" / "figures", help="folder for scaling_*.json and .png")
    args = p.parse_args(argv)
    for t in args.tokens:
        if math.isqrt(t) ** 2 != t:
            p.error(f"--tokens {t} is not a square number, so no square latent gives it at patch {PATCH}; use e.g. 256, 1024, 4096 or 16384")
        if args.tokens_per_step % t:
            p.error(f"--tokens-per-step {args.tokens_per_step} is not a multiple of --tokens {t}, so the batch would not be whole; "
                    f"use a multiple of {max(args.tokens)}")
    if args.flops_only and args.dry_run:
        p.error("--flops-only and --dry-run each ask for one part; give one of them, or neither for both on a CPU")
    if args.device is not None and not args.device.startswith("cuda") and not (args.flops_only or args.dry_run):
        p.error(f"--device {args.device} cannot time the grid; timing needs a CUDA GPU (add --flops-only or --dry-run on the CPU)")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.tokens = sorted(set(args.tokens))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    device = torch.device(args.device)
    timed = device.type == "cuda" and not (args.flops_only or args.dry_run)
    groups = grid(args.families, args.widths, args.tokens, args.tokens_per_step)
    command = "python -m train.bench.scaling " + " ".join(sys.argv[1:] if argv is None else argv)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    head = {"command": command, "date": now(), "device": where, "torch": torch.__version__, "tokens_per_step": args.tokens_per_step,
            "flops": "routing.count_flops on fake tensors (matmuls, convolutions, attention with the CUDA kernels' "
                     "formulas; scans opaque) of one training step: forward and backward (AdamW's element-wise work counts none)"}
    print(f"scaling grid: {', '.join(args.families)} x {', '.join(RECIPES)} x {', '.join(args.widths)} x tokens "
          f"{', '.join(map(str, args.tokens))}, {args.tokens_per_step:,} tokens per step, on {where}", flush=True)
    result = {}
    if timed:
        peak = peak_tflops(device, args.peak_tflops)
        rows = list(timed_rows(groups, device, args.repeats, args.warmup, peak, lambda line: print(line, flush=True)))
        report = {**head, "bf16": True, "compile": "off", "repeats": args.repeats, "warmup": args.warmup,
                  "peak_tflops": peak, "rows": rows}
        print(table(rows, timed=True))
        paths = write(args.out, "steps", report, "ms", "ms per training step (bf16, eager)",
                      f"Training step time against tokens at {args.tokens_per_step:,} tokens per step, {where}")
        print(f"wrote {paths[0]} and {paths[1]}", flush=True)
        result["steps"] = report
    else:
        if device.type != "cuda" and not (args.flops_only or args.dry_run):
            print("no CUDA GPU: the FLOP curve and the dry run (GPU: not measured)", flush=True)
        if not args.dry_run:
            rows = flop_rows(groups)
            report = {**head, "device": "none (fake tensors)", "rows": rows}
            print(table(rows, timed=False))
            paths = write(args.out, "flops", report, "flops", "FLOPs per training step",
                          f"Counted FLOPs of one training step against tokens, {args.tokens_per_step:,} tokens per step")
            print(f"wrote {paths[0]} and {paths[1]}", flush=True)
            result["flops"] = report
        if not args.flops_only:
            rows = dry_run(args.families, args.tokens[0])
            print(f"dry run: {sum(r['fits'] for r in rows)} of {len(rows)} cells built and stepped once "
                  f"(preset {DRY_RUN_PRESET}, {args.tokens[0]} tokens, batch 1, CPU; times not reported)", flush=True)
            result["dry_run"] = rows
    return result


if __name__ == "__main__":
    main()
