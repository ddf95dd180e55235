"""Routed vs unrouted training-step cost, in one run: FLOPs, FLOP-ideal speedup, measured speedup.

    python -m train.bench.routing --backbone dit --presets tiny S --policy random
    python -m train.bench.routing --presets S B XL --batch 128 --device cuda --bf16 --compile model --repeats 20 --warmup 5
    python -m train.bench.routing --presets XL --batch 64 --device cuda --bf16 --compile model --cuda-graphs --policy sprint

Each preset is built twice from the same weights, once with `configs/routing/none.yaml` and once with the
chosen policy's YAML (TREAD's default route r2->depth-4, ratio 0.5); steps are timed interleaved, the routed
one drawing its routes before the forward from a per-step generator, as the trainer does (Router.set_draws).
--compile blocks (or --compile alone) compiles every block as `trainer.compile=blocks` does; --compile model the
whole denoiser as `trainer.compile=model`; --cuda-graphs adds `trainer.cuda_graphs`, --compile-regions
`trainer.compile_regions`. The first routed and unrouted
steps (compilation) are timed apart and the number of graphs is printed. On CUDA the table adds model FLOPs
utilization: counted FLOPs / step time / the card's dense bf16 peak (--peak-tflops, or known from its name).
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from backbones import build_backbone
from edm import EDMPrecond
from train.build import build_router
from train.compiling import MODES, compile_network, compiled_graphs
from routing import count_flops
from train.bench.gpu_profile import profile_call
from train.bench.spread import interleaved_rounds
from train.bench.timing import training_step
from train.cli import ArgumentParser, bounded, check_presets, check_scan_switches, check_tokens, device as device_type

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def routed_pair(backbone: str, preset: str, policy: str, input_size: int, channels: int, patch: int, num_classes: int, device):
    """Two denoisers sharing one set of weights: unrouted and routed with `policy`."""
    model = build_backbone(backbone, preset, input_size=input_size, in_channels=channels, patch_size=patch, num_classes=num_classes)
    routing = OmegaConf.load(CONFIGS / "routing" / f"{policy}.yaml")
    routing.allow_unstructured = True  # the benchmark also measures the 1-D ablation for scan models
    router, plain = build_router(routing, model), model.router
    model.attach_router(router)  # a SPRINT route's fusion layer joins the model; the unrouted runs leave it unused
    model.router = plain
    # Selection drawn on the device, as the trainer does: no host copy per route.
    router.generator = torch.Generator(device=device).manual_seed(0)
    net = EDMPrecond(model).to(device).train()
    return net, router


# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) of cards the benchmark knows by name.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def measure(args, preset: str) -> dict:
    device = torch.device(args.device)
    net, router = routed_pair(args.backbone, preset, args.policy, args.input_size, args.channels, args.patch, 1000, device)
    model = net.model
    shape = (args.channels, args.input_size, args.input_size)
    plain_router = model.router
    draws = torch.Generator(device=device)
    calls = itertools.count()
    compiled = {"net": net}

    def fresh_draws():
        # As the trainer: the routes of a step drawn before its forward, from a generator seeded per step.
        router.set_draws(draws.manual_seed(next(calls)), 0, args.batch)

    step = training_step(_Forward(compiled), args.batch, shape, 1000, device)

    def unrouted():
        model.router = plain_router
        step()

    def routed():
        model.router = router
        fresh_draws()
        step()

    flops = {"unrouted": count_flops(unrouted, grad=True), "routed": count_flops(routed, grad=True)}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    compile_seconds, graphs = None, None
    if args.compile != "off":
        compiled["net"] = compile_network(net, model, args.compile, args.cuda_graphs, regions=args.compile_regions)
        plain_router.regions = router.regions  # the routers take turns: the unrouted graph's blocks are regions too
    before = compiled_graphs()
    tic = time.perf_counter()  # the first steps, compiled or not: what a user waits before the first logged step
    with autocast:
        unrouted()
        routed()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_seconds = time.perf_counter() - tic
    if args.compile != "off":
        compile_seconds, graphs = first_seconds, compiled_graphs() - before
    with autocast:
        rounds = interleaved_rounds({"unrouted": unrouted, "routed": routed}, args.rounds, args.repeats, args.warmup, device)
        profiles = {k: profile_call(fn, device) for k, fn in (("unrouted", unrouted), ("routed", routed))} if args.profile else None
    seconds = {k: statistics.median(v) for k, v in rounds.items()}
    peak = peak_tflops(device, args.peak_tflops)
    mfu = {k: flops[k] / seconds[k] / (peak * 1e12) for k in flops} if peak else {"unrouted": None, "routed": None}
    ideal = flops["unrouted"] / flops["routed"]
    measured = seconds["unrouted"] / seconds["routed"]
    route = router.routes[0]
    # Each round's own numbers (its unrouted and routed medians were timed interleaved), for the median and range.
    per_round = {"ms_unrouted": [s * 1e3 for s in rounds["unrouted"]], "ms_routed": [s * 1e3 for s in rounds["routed"]],
                 "efficiency": [u / r / ideal for u, r in zip(rounds["unrouted"], rounds["routed"])],
                 "mfu_unrouted": [flops["unrouted"] / s / (peak * 1e12) if peak else None for s in rounds["unrouted"]],
                 "mfu_routed": [flops["routed"] / s / (peak * 1e12) if peak else None for s in rounds["routed"]]}
    return {
        "preset": preset, "tokens": model.grid[0] * model.grid[1], "batch": args.batch,
        "route": f"r{route.start_layer_idx}->{route.end_layer_idx} x{route.selection_ratio}",
        "gflops_unrouted": flops["unrouted"] / 1e9, "gflops_routed": flops["routed"] / 1e9,
        "ideal": ideal, "ms_unrouted": seconds["unrouted"] * 1e3, "ms_routed": seconds["routed"] * 1e3,
        "measured": measured, "efficiency": measured / ideal,
        "mfu_unrouted": mfu["unrouted"], "mfu_routed": mfu["routed"], "compile_s": compile_seconds, "graphs": graphs,
        "first_s": first_seconds, "rounds": per_round, "profile": profiles,
    }


def main(argv=None) -> list[dict]:
    p = ArgumentParser(prog="python -m train.bench.routing", description=__doc__.splitlines()[0])
    p.add_argument("--backbone", default="dit", choices=["dit", "rwkv", "mamba", "diffmoe"])
    p.add_argument("--presets", nargs="+", default=["tiny", "S"])
    p.add_argument("--policy", default="random", choices=sorted(f.stem for f in (CONFIGS / "routing").glob("*.yaml") if f.stem != "none"),
                   help="routing config (configs/routing/) to compare with none")
    p.add_argument("--input-size", type=bounded(int, 1, example="--input-size 32"), default=32, help="latent side; 32 with patch 2 gives 256 tokens")
    p.add_argument("--channels", type=bounded(int, 1, example="--channels 4"), default=4)
    p.add_argument("--patch", type=bounded(int, 1, example="--patch 2"), default=2)
    p.add_argument("--batch", type=bounded(int, 1, example="--batch 8"), default=8)
    p.add_argument("--repeats", type=bounded(int, 1, example="--repeats 7"), default=7)
    p.add_argument("--warmup", type=bounded(int, 0, example="--warmup 2"), default=2)
    p.add_argument("--rounds", type=bounded(int, 1, example="--rounds 3"), default=1, help="rounds of interleaved repeats; each row keeps every round's numbers")
    p.add_argument("--profile", action="store_true", help="profile one unrouted and one routed step after timing (torch.profiler)")
    p.add_argument("--device", type=device_type, default="cpu")
    p.add_argument("--bf16", action="store_true", help="autocast to bf16 (GPU)")
    p.add_argument("--threads", type=bounded(int, 1, example="--threads 2"), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", nargs="?", const="blocks", default="off", choices=MODES,
                   help="off; blocks (each block compiled, as trainer.compile=blocks; --compile alone); model (the whole denoiser)")
    p.add_argument("--cuda-graphs", action="store_true", help="capture the compiled step in CUDA graphs (with --compile model on CUDA)")
    p.add_argument("--compile-regions", action="store_true", help="each block a nested compile region, compiled once (with --compile model)")
    p.add_argument("--peak-tflops", type=bounded(float, 0.001, example="--peak-tflops 989"), default=None,
                   help="the card's dense bf16 peak, for MFU (default: known cards)")
    args = p.parse_args(argv)
    check_presets(p, args.backbone, args.presets)
    check_tokens(p, args.input_size, args.patch)
    check_scan_switches(p, args.device.startswith("cuda"))
    if args.compile_regions and args.compile != "model":
        p.error(f"--compile-regions makes regions inside the whole compiled network; add --compile model (not {args.compile})")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"cpu, threads={torch.get_num_threads()}"
    print(f"{args.backbone} | policy={args.policy} | {where} | bf16={args.bf16} | compile={args.compile}{' +regions' if args.compile_regions else ''}{' +cuda graphs' if args.cuda_graphs else ''} | torch {torch.__version__}")
    header = ("| preset | tokens | batch | route | GFLOPs unrouted | GFLOPs routed | ideal speedup | ms unrouted | ms routed | "
              "measured speedup | efficiency | MFU unrouted | MFU routed | compile s (graphs) |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    rows = []
    for preset in args.presets:
        r = measure(args, preset)
        rows.append(r)
        print(f"| {args.backbone}-{r['preset']}/{args.patch} | {r['tokens']} | {r['batch']} | {r['route']} | {r['gflops_unrouted']:.1f} | "
              f"{r['gflops_routed']:.1f} | {r['ideal']:.3f}x | {r['ms_unrouted']:.1f} | {r['ms_routed']:.1f} | "
              f"{r['measured']:.3f}x | {r['efficiency']:.2f} | {_pct(r['mfu_unrouted'])} | {_pct(r['mfu_routed'])} | "
              f"{_compiled(r)} |", flush=True)
    return rows


class _Forward:
    """The network a step calls: eager at first, the compiled one once the benchmark compiles (the step's optimizer
    keeps the eager module's parameters, which the compiled network shares)."""

    def __init__(self, holder: dict):
        self.holder = holder

    def __call__(self, *args, **kwargs):
        return self.holder["net"](*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.holder["net"], name)


def _compiled(row: dict) -> str:
    return "-" if row["compile_s"] is None else f"{row['compile_s']:.0f} ({row['graphs']})"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


if __name__ == "__main__":
    main()
