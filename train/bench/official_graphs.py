"""Which of the official DiT's compiled graphs serves each block call, unrouted and routed.

    python -m train.bench.official_graphs --tread ~/tread-official                 # CPU, DiT-XL/2's depth at width 64
    python -m train.bench.official_graphs --tread ~/tread-official --device cuda --width 1152 --heads 16

CompVis/tread's blocks carry `@torch.compile`, and a routed step hands them three signatures: the whole sequence
under autocast, the routed subset (fewer tokens), and the block after the route with autocast off. Whether that
recompiles, makes the token count symbolic or meets dynamo's recompile limit (after which a block runs eager for
good) is hypothesis 2 of why the official routed step saved only 8% on an H100 (docs/reports/2026-11-26-h100-gpu-check.md).
Dynamo decides it from shapes, strides and the autocast state, not from the device or the width, so a narrow model
on the CPU answers it; there the official `autocast(device_type="cuda", enabled=False)` is applied to the CPU's
autocast, so the block after the route sees what it sees on a GPU. The official dit.py is loaded by path as
train.bench.official loads it, its `@torch.compile` given a backend that is Inductor with a counter around each graph.
"""

from __future__ import annotations

import collections
import contextlib
import time
from unittest import mock

import torch
from torch._inductor.compile_fx import compile_fx

from routing import ConfigError
from train.bench.official import load_official
from train.cli import ArgumentParser, bounded, check_tokens, device as device_type, refuse


class _CpuAutocast(torch.amp.autocast):
    """torch.amp.autocast with device_type "cuda" taken as "cpu": the official fp32 block's switch, on the CPU."""

    def __init__(self, device_type: str, *args, **kwargs):
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


class GraphLedger:
    """A torch.compile backend (Inductor's compile_fx) that numbers each graph it compiles and counts its calls
    under the label of the step that made them."""

    def __init__(self, device: torch.device):
        self.device, self.label = device, None
        self.graphs: list[dict] = []
        self.calls: collections.Counter = collections.Counter()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> callable:
        index = len(self.graphs)
        sizes = [s for t in example_inputs if isinstance(t, torch.Tensor) for s in t.shape]
        # Which forward it is: the submodules whose parameters it takes (the block's attn and mlp, the final layer's linear).
        modules = sorted({fqn.split(".")[0] for fqn in gm.meta.get("dynamo_flat_name_to_original_fqn", {}).values()})
        self.graphs.append({"graph": index, "compile_id": str(gm.meta.get("dynamo_compile_id", "?")), "modules": modules,
                            "symbolic": any(isinstance(s, torch.SymInt) for s in sizes + example_inputs),
                            "autocast": torch.is_autocast_enabled(self.device.type), "nodes": len(gm.graph.nodes)})
        compiled = compile_fx(gm, example_inputs)

        def run(*args):
            self.calls[self.label, index] += 1
            return compiled(*args)

        return run


def parse(argv=None):
    p = ArgumentParser(prog="python -m train.bench.official_graphs", description=__doc__.split("\n\n")[0])
    p.add_argument("--tread", required=True, help="folder with the official dit.py and routing_module.py")
    p.add_argument("--depth", type=bounded(int, 4, example="--depth 28"), default=28, help="blocks (DiT-XL/2: 28)")
    p.add_argument("--width", type=bounded(int, 8, example="--width 64"), default=64, help="hidden size (DiT-XL/2: 1152)")
    p.add_argument("--heads", type=bounded(int, 1, example="--heads 2"), default=2)
    p.add_argument("--input-size", type=bounded(int, 2, example="--input-size 32"), default=32, help="latent side")
    p.add_argument("--patch", type=bounded(int, 1, example="--patch 2"), default=2)
    p.add_argument("--batch", type=bounded(int, 1, example="--batch 2"), default=2)
    p.add_argument("--steps", type=bounded(int, 1, example="--steps 2"), default=2, help="unrouted + routed pairs")
    p.add_argument("--device", type=device_type, default="cpu")
    args = p.parse_args(argv)
    check_tokens(p, args.input_size, args.patch)
    if args.width % args.heads:
        p.error(f"--width {args.width} is not divisible by --heads {args.heads}; pick a width that is (e.g. --width {64 * args.heads})")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device(args.device)
    ledger = GraphLedger(device)
    inductor = torch.compile
    try:  # the decorator runs as dit.py is executed: its blocks compile through the ledger
        with mock.patch.object(torch, "compile", lambda fn=None, **kw: inductor(fn, backend=ledger)):
            module = load_official(args.tread)
    except ConfigError as err:
        refuse(err)
    # TREAD's route for this depth, as configs/routing/random.yaml resolves it: r2 -> depth-4, half the tokens.
    route = dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=args.depth - 4)
    torch.manual_seed(0)
    dit = module.DiT(input_size=args.input_size, patch_size=args.patch, in_channels=4, hidden_size=args.width,
                     depth=args.depth, num_heads=args.heads, num_classes=1000, enable_routing=True, routes=[route])
    dit = dit.to(device).train()
    x = torch.randn(args.batch, 4, args.input_size, args.input_size, device=device)
    t, y = torch.rand(args.batch, device=device), torch.randint(0, 1000, (args.batch,), device=device)
    fp32_switch = mock.patch.object(torch.amp, "autocast", _CpuAutocast) if device.type == "cpu" else contextlib.nullcontext()
    print(f"official DiT, depth {args.depth}, width {args.width}, {(args.input_size // args.patch) ** 2} tokens, batch "
          f"{args.batch}, route r2->{args.depth - 4} x0.5, bf16 autocast on {device.type} | torch {torch.__version__}")
    seconds = {}
    with fp32_switch:
        for i in range(args.steps):
            for routed in (False, True):
                ledger.label = f"{'routed' if routed else 'unrouted'} {i + 1}"
                dit.enable_routing = routed
                start = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    out = dit(x, t, y)
                out = out["x"] if isinstance(out, dict) else out
                out.float().square().mean().backward()
                seconds[ledger.label] = time.perf_counter() - start
    print("| graph | dynamo's id (code/compile) | its parameters' modules | symbolic sizes | autocast | FX nodes |\n|---|---|---|---|---|---|")
    for g in ledger.graphs:
        print(f"| {g['graph']} | {g['compile_id']} | {', '.join(g['modules'])} | {'yes' if g['symbolic'] else 'no'} | "
              f"{'on' if g['autocast'] else 'off'} | {g['nodes']} |")
    print("| step | seconds (compiles in the first) | calls per graph |\n|---|---|---|")
    for label, s in seconds.items():
        calls = ", ".join(f"graph {g}: {n}" for (lab, g), n in sorted(ledger.calls.items()) if lab == label)
        print(f"| {label} | {s:.1f} | {calls} |")
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    per_code = collections.Counter(g["compile_id"].split("/")[0] for g in ledger.graphs)
    print(f"graphs per compiled code object: {dict(per_code)}; dynamo's recompile limit: {limit} per code object")
    return {"graphs": ledger.graphs, "calls": {f"{lab} | graph {g}": n for (lab, g), n in ledger.calls.items()}}


if __name__ == "__main__":
    main()
