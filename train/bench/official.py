"""Our DiT against CompVis/tread's DiT, side by side in one run: the same size, the same route, the same EDM step.

    python -m train.bench.official --tread ~/tread-official --presets XL --batch 64 --device cuda --bf16 --compile model
    python -m train.bench.official --tread ~/tread-official --presets XL --batch 64 --device cuda --bf16 --compile model --cuda-graphs

The official code is not part of this repository (its licence is non-commercial) and nothing here is taken from
it: --tread names a folder holding a local copy of its dit.py and routing_module.py, which this script loads by
path at run time (docs/performance.md says how to make the copy). Only its public surface is used: `DiT_models`
and `get_model(name, params)` for the paper sizes (`DiT` itself for a size it does not name, such as tiny), the
routes as dicts {selection_ratio, start_layer_idx, end_layer_idx}, `enable_routing`, and forward(x, t, y).

Both models get the route of configs/routing/random.yaml resolved for the preset's depth (TREAD's r2->depth-4,
half the tokens bypassing: r2->24 x0.5 for XL), and both are wrapped in our EDM preconditioning and run
train.bench.timing's step (EDM loss on fixed random data, backward, AdamW, fused on CUDA). The official block after
a route runs with autocast disabled, so ours runs with routing.fp32_after_route=true. Its blocks carry their own
`@torch.compile`; ours are compiled as --compile says. The four steps (official and ours, unrouted and routed)
are timed interleaved; the first steps of each side (compilation) are timed apart.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from backbones.dit import PRESETS
from edm import EDMPrecond
from routing import ConfigError, count_flops
from train.bench.routing import _Forward, peak_tflops, routed_pair
from train.bench.timing import interleaved_medians, step_clock, training_step
from train.cli import ArgumentParser, bounded, check_tokens, device as device_type, refuse
from train.compiling import MODES, compile_network, compiled_graphs

FILES = ("dit.py", "routing_module.py")
API = ("get_model", "DiT_models", "DiT")  # what dit.py must define
GOAL_RATIO = 0.8  # issue 37: our routed step at most 0.8x the official one


def load_official(folder) -> ModuleType:
    """The official dit.py in `folder`, imported by path (its `from routing_module import ...` resolved in the same
    folder); ConfigError in one sentence when the folder, a file or the API is missing."""
    fix = ("put a copy of dit.py and routing_module.py from a clone of github.com/CompVis/tread there "
           "(docs/performance.md, 'Side by side with the official code')")
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--tread {folder} is not a folder; {fix}.")
    missing = [name for name in FILES if not (folder / name).is_file()]
    if missing:
        raise ConfigError(f"--tread {folder} has no {' or '.join(missing)}; {fix}.")
    module = _import_by_path(folder)
    lacking = [name for name in API if not hasattr(module, name)]
    if lacking or not isinstance(module.DiT_models, Mapping):
        raise ConfigError(f"--tread {folder}: its dit.py does not define {', '.join(lacking) or 'DiT_models as a dict'}, "
                          f"so it is not CompVis/tread's; {fix}.")
    return module


def fingerprint(folder) -> str:
    """The first 12 hex digits of the SHA-256 of dit.py and routing_module.py together: which copy was measured."""
    digest = hashlib.sha256()
    for name in FILES:
        digest.update((Path(folder).expanduser() / name).read_bytes())
    return digest.hexdigest()[:12]


def _import_by_path(folder: Path) -> ModuleType:
    """Execute folder/dit.py as a module of its own. The folder leads sys.path only during the import, and
    `routing_module` is removed from sys.modules afterwards (dit.py keeps its reference), so nothing of the
    copy shadows our packages or survives into the next load."""
    before = sys.modules.pop("routing_module", None)
    spec = importlib.util.spec_from_file_location("tread_official_dit", folder / "dit.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        raise ConfigError(f"--tread {folder}: its dit.py could not import {err.name or err}; install that package "
                          "(the official code needs timm and numpy) or fix the copy.") from None
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("routing_module", None)
        if before is not None:
            sys.modules["routing_module"] = before
    return module


class OfficialDenoiser(nn.Module):
    """The official DiT behind our EDM preconditioning: EDMPrecond calls model(x, c_noise, labels), which is the
    official forward(x, t, y). It returns the image tensor; a dict is read at "x", as its own demo reads it."""

    def __init__(self, dit: nn.Module):
        super().__init__()
        self.dit = dit

    def forward(self, x: torch.Tensor, noise_labels: torch.Tensor, class_labels: torch.Tensor) -> torch.Tensor:
        out = self.dit(x, noise_labels, class_labels)
        if isinstance(out, Mapping):
            out = out["x"]
        return out


def build_official(module: ModuleType, preset: str, input_size: int, channels: int, patch: int, num_classes: int,
                   routes: list[dict]) -> tuple[nn.Module, str]:
    """(the official DiT with routing enabled, how it was built): by its own name for the paper sizes, else
    (tiny) its DiT class at our preset's width, depth and heads."""
    params = dict(input_size=input_size, in_channels=channels, num_classes=num_classes, enable_routing=True, routes=routes)
    name = f"DiT-{preset}/{patch}"
    if name in module.DiT_models:
        return module.get_model(name, params), f"get_model({name!r})"
    return module.DiT(patch_size=patch, **PRESETS[preset], **params), f"DiT(**PRESETS[{preset!r}])"


def measure(args, preset: str, module: ModuleType) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    net, router = routed_pair("dit", preset, "random", args.input_size, args.channels, args.patch, 1000, device)
    model = net.model
    router.fp32_after_route = True  # as the official forward runs the block after a route
    routes = [dict(selection_ratio=r.selection_ratio, start_layer_idx=r.start_layer_idx, end_layer_idx=r.end_layer_idx)
              for r in router.routes]
    torch.manual_seed(0)
    dit, built = build_official(module, preset, args.input_size, args.channels, args.patch, 1000, routes)
    official = EDMPrecond(OfficialDenoiser(dit)).to(device).train()
    shape = (args.channels, args.input_size, args.input_size)

    plain_router, draws, calls, compiled = model.router, torch.Generator(device=device), itertools.count(), {"net": net}
    ours = training_step(_Forward(compiled), args.batch, shape, 1000, device)
    theirs = training_step(official, args.batch, shape, 1000, device)

    def ours_unrouted():
        model.router = plain_router
        ours()

    def ours_routed():
        model.router = router
        router.set_draws(draws.manual_seed(next(calls)), 0, args.batch)  # as the trainer: drawn before the forward
        ours()

    def official_unrouted():
        dit.enable_routing = False
        theirs()

    def official_routed():
        dit.enable_routing = True  # it draws its routes inside the forward, from the global generator
        theirs()

    flops = {"unrouted": count_flops(ours_unrouted, grad=True), "routed": count_flops(ours_routed, grad=True)}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    if args.compile != "off":
        compiled["net"] = compile_network(net, model, args.compile, args.cuda_graphs, regions=args.compile_regions)
        plain_router.regions = router.regions  # the routers take turns: the unrouted graph's blocks are regions too
    before = compiled_graphs()
    first = {"ours": _first_steps((ours_unrouted, ours_routed), autocast, device)}
    graphs = compiled_graphs() - before  # ours only: the official blocks compile in the next call
    first["official"] = _first_steps((official_unrouted, official_routed), autocast, device)
    fns = {"official unrouted": official_unrouted, "ours unrouted": ours_unrouted,
           "official routed": official_routed, "ours routed": ours_routed}
    clock, _ = step_clock(device, args.threads)
    with autocast:
        seconds = interleaved_medians(fns, args.repeats, args.warmup, device, clock=clock)
    peak = peak_tflops(device, args.peak_tflops)
    route = router.routes[0]
    row = {"preset": preset, "tokens": model.grid[0] * model.grid[1], "batch": args.batch, "built": built,
           "route": f"r{route.start_layer_idx}->{route.end_layer_idx} x{route.selection_ratio}",
           "params_official": _trained(dit), "params_ours": _trained(model), "fp32_after_route": router.fp32_after_route,
           "compile": args.compile, "cuda_graphs": args.cuda_graphs, "regions": args.compile_regions, "compile_s": first["ours"] if args.compile != "off" else None,
           "graphs": graphs if args.compile != "off" else None, "official_first_s": first["official"]}
    for kind in ("unrouted", "routed"):
        row[f"ms_official_{kind}"] = seconds[f"official {kind}"] * 1e3
        row[f"ms_ours_{kind}"] = seconds[f"ours {kind}"] * 1e3
        row[f"ratio_{kind}"] = seconds[f"ours {kind}"] / seconds[f"official {kind}"]
        row[f"mfu_{kind}"] = flops[kind] / seconds[f"ours {kind}"] / (peak * 1e12) if peak else None
    return row


def _first_steps(steps, autocast, device) -> float:
    """Seconds of one call of each step, compilation included."""
    tic = time.perf_counter()
    with autocast:
        for step in steps:
            step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - tic


def parse(argv=None):
    p = ArgumentParser(prog="python -m train.bench.official", description=__doc__.splitlines()[0])
    p.add_argument("--tread", required=True, metavar="DIR", help="folder with a local copy of CompVis/tread's dit.py and routing_module.py")
    p.add_argument("--presets", nargs="+", default=["XL"], choices=list(PRESETS))
    p.add_argument("--input-size", type=bounded(int, 1, example="--input-size 32"), default=32, help="latent side; 32 with patch 2 gives 256 tokens")
    p.add_argument("--channels", type=bounded(int, 1, example="--channels 4"), default=4)
    p.add_argument("--patch", type=bounded(int, 1, example="--patch 2"), default=2)
    p.add_argument("--batch", type=bounded(int, 1, example="--batch 64"), default=64)
    p.add_argument("--repeats", type=bounded(int, 1, example="--repeats 7"), default=7)
    p.add_argument("--warmup", type=bounded(int, 0, example="--warmup 2"), default=2)
    p.add_argument("--device", type=device_type, default="cpu")
    p.add_argument("--bf16", action="store_true", help="autocast to bf16 (GPU)")
    p.add_argument("--threads", type=bounded(int, 1, example="--threads 2"), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", nargs="?", const="blocks", default="off", choices=MODES,
                   help="how ours runs: off; blocks (each block, as trainer.compile=blocks); model (the whole denoiser). "
                        "The official blocks compile themselves (their @torch.compile)")
    p.add_argument("--cuda-graphs", action="store_true", help="capture our compiled step in CUDA graphs (with --compile model on CUDA)")
    p.add_argument("--compile-regions", action="store_true", help="each of our blocks a nested compile region, compiled once (with --compile model)")
    p.add_argument("--peak-tflops", type=bounded(float, 0.001, example="--peak-tflops 989"), default=None,
                   help="the card's dense bf16 peak, for MFU (default: known cards)")
    args = p.parse_args(argv)
    check_tokens(p, args.input_size, args.patch)
    if args.compile_regions and args.compile != "model":
        p.error(f"--compile-regions makes regions inside the whole compiled network; add --compile model (not {args.compile})")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    try:
        module = load_official(args.tread)
    except ConfigError as err:
        refuse(err)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The official blocks compile themselves unless torch.compile is switched off for the process (which it
    # reads from either variable); then both sides run eager, whatever --compile says.
    off = torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1"
    theirs = "eager: torch.compile disabled for the process, ours too" if off else "its blocks' @torch.compile"
    where = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else f"cpu, threads={torch.get_num_threads()}"
    print(f"DiT side by side with CompVis/tread's (from {Path(args.tread).expanduser()}, files sha256 {fingerprint(args.tread)}) | "
          f"{where} | bf16={args.bf16} | "
          f"ours: compile={args.compile}{' +regions' if args.compile_regions else ''}{' +cuda graphs' if args.cuda_graphs else ''} | official: {theirs} | torch {torch.__version__}")
    header = "| model | route | batch | step | official ms | ours ms | ours / official | MFU ours |"
    rows = []
    for preset in args.presets:
        r = {**measure(args, preset, module), "official_sha256": fingerprint(args.tread)}
        rows.append(r)
        print(f"DiT-{preset}/{args.patch}, {r['tokens']} tokens: official built by {r['built']}, {r['params_official']:,} "
              f"trained parameters; ours {r['params_ours']:,}, routing.fp32_after_route={str(r['fp32_after_route']).lower()} "
              "(the official block after a route runs in fp32)")
        print(header)
        print("|---" * (header.count("|") - 1) + "|")
        for kind in ("unrouted", "routed"):
            goal = f" (goal <= {GOAL_RATIO}x)" if kind == "routed" else ""
            print(f"| DiT-{preset}/{args.patch} | {r['route'] if kind == 'routed' else '-'} | {r['batch']} | {kind} | "
                  f"{r[f'ms_official_{kind}']:.1f} | {r[f'ms_ours_{kind}']:.1f} | {r[f'ratio_{kind}']:.3f}x{goal} | "
                  f"{_pct(r[f'mfu_{kind}'])} |")
        ours = "eager, not compiled" if r["compile_s"] is None else f"{r['compile_s']:.1f} s ({r['graphs']} graphs) compiling, with the first steps"
        print(f"first unrouted + routed steps: ours {ours}; official {r['official_first_s']:.1f} s ({theirs})", flush=True)
    return rows


def _trained(module: nn.Module) -> int:
    """Parameters that train: the official position embedding is a frozen Parameter, ours a buffer."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


if __name__ == "__main__":
    main()
