"""Routed vs unrouted training-step cost, in one run: FLOPs, FLOP-ideal speedup, measured speedup.

    python -m train.bench.routing --backbone dit --presets tiny S --policy random

Each preset is built twice from the same weights, once with `configs/routing/none.yaml` and once with the
chosen policy's YAML (TREAD's default route r2->depth-4, ratio 0.5); steps are timed interleaved.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from omegaconf import OmegaConf

from backbones import build_backbone
from edm import EDMPrecond
from train.build import build_router
from train.bench.timing import count_flops, interleaved_medians, training_step

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def routed_pair(backbone: str, preset: str, policy: str, input_size: int, channels: int, patch: int, num_classes: int, device):
    """Two denoisers sharing one set of weights: unrouted and routed with `policy`."""
    model = build_backbone(backbone, preset, input_size=input_size, in_channels=channels, patch_size=patch, num_classes=num_classes)
    routing = OmegaConf.load(CONFIGS / "routing" / f"{policy}.yaml")
    routing.allow_unstructured = True  # the benchmark also measures the 1-D ablation for scan models
    router = build_router(routing, model)
    net = EDMPrecond(model).to(device).train()
    return net, router


def measure(args, preset: str) -> dict:
    device = torch.device(args.device)
    net, router = routed_pair(args.backbone, preset, args.policy, args.input_size, args.channels, args.patch, 1000, device)
    model = net.model
    shape = (args.channels, args.input_size, args.input_size)
    plain_router = model.router
    step = training_step(net, args.batch, shape, 1000, device)

    def unrouted():
        model.router = plain_router
        step()

    def routed():
        model.router = router
        step()

    flops = {"unrouted": count_flops(unrouted), "routed": count_flops(routed)}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    with autocast:
        seconds = interleaved_medians({"unrouted": unrouted, "routed": routed}, args.repeats, args.warmup, device)
    ideal = flops["unrouted"] / flops["routed"]
    measured = seconds["unrouted"] / seconds["routed"]
    route = router.routes[0]
    return {
        "preset": preset, "tokens": model.grid[0] * model.grid[1], "batch": args.batch,
        "route": f"r{route.start_layer_idx}->{route.end_layer_idx} x{route.selection_ratio}",
        "gflops_unrouted": flops["unrouted"] / 1e9, "gflops_routed": flops["routed"] / 1e9,
        "ideal": ideal, "ms_unrouted": seconds["unrouted"] * 1e3, "ms_routed": seconds["routed"] * 1e3,
        "measured": measured, "efficiency": measured / ideal,
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m train.bench.routing", description=__doc__.splitlines()[0])
    p.add_argument("--backbone", default="dit", choices=["dit", "rwkv", "mamba"])
    p.add_argument("--presets", nargs="+", default=["tiny", "S"])
    p.add_argument("--policy", default="random", help="routing config to compare with none (random, rows, l1norm)")
    p.add_argument("--input-size", type=int, default=32, help="latent side; 32 with patch 2 gives 256 tokens")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="autocast to bf16 (GPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{args.backbone} | policy={args.policy} | device={args.device} | threads={torch.get_num_threads()} | bf16={args.bf16}")
    header = "| preset | tokens | batch | route | GFLOPs unrouted | GFLOPs routed | ideal speedup | ms unrouted | ms routed | measured speedup | efficiency |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    rows = []
    for preset in args.presets:
        r = measure(args, preset)
        rows.append(r)
        print(f"| {args.backbone}-{r['preset']}/{args.patch} | {r['tokens']} | {r['batch']} | {r['route']} | {r['gflops_unrouted']:.1f} | "
              f"{r['gflops_routed']:.1f} | {r['ideal']:.3f}x | {r['ms_unrouted']:.1f} | {r['ms_routed']:.1f} | "
              f"{r['measured']:.3f}x | {r['efficiency']:.2f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
