"""`python -m train.sample RUN_OR_CHECKPOINT`: sample a class-conditional image grid from EMA weights.

    python -m train.sample runs/2026-11-22_10-00-00 --guidance 2 --steps 40 --seed 0 --out grid.png
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from routing import ConfigError
from train.build import build_net
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.cli import friendly_errors
from train.data import build_dataset
from train.grid import generate, grid_labels, save_grid

__all__ = ["Loaded", "generate", "load_run", "main"]


@dataclass
class Loaded:
    net: torch.nn.Module  # EDM denoiser with EMA weights, eval mode: net(x, sigma, class_labels)
    cfg: DictConfig
    dataset: object
    checkpoint: Path
    step: int


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (its latest checkpoint)."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path
    latest = latest_checkpoint(path / "checkpoints")
    if latest is None:
        raise ConfigError(f"'{path}' is neither a checkpoint folder nor a run folder with checkpoints/latest; pass runs/X or runs/X/checkpoints/step_N.")
    return latest


def load_run(checkpoint: str | Path, device: str | torch.device = "cpu") -> Loaded:
    path = resolve_checkpoint(checkpoint)
    state = load_checkpoint(path)
    cfg = state["config"]
    dataset = build_dataset(cfg.data, cfg.edm.sigma_data)
    net = build_net(cfg, dataset)
    net.load_state_dict(state["ema"])
    return Loaded(net.to(device).eval(), cfg, dataset, path, state["step"])


@friendly_errors
def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m train.sample", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="run folder (uses its latest checkpoint) or a checkpoint folder")
    parser.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance scale w (1 = off)")
    parser.add_argument("--steps", type=int, default=40, help="Heun steps (EDM default 40)")
    parser.add_argument("--sampler", default="heun", choices=["heun", "euler"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-class", type=int, default=8, help="samples per class (one grid row per class)")
    parser.add_argument("--classes", type=int, nargs="*", help="class ids to sample (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="PNG path (default: <checkpoint>/samples_w<guidance>_seed<seed>.png)")
    args = parser.parse_args(argv)

    loaded = load_run(args.checkpoint, args.device)
    ds = loaded.dataset
    if args.classes:
        bad = [c for c in args.classes if not 0 <= c < ds.num_classes]
        if bad:
            raise ConfigError(f"--classes {bad} out of range; this model has classes 0..{ds.num_classes - 1}.")
        labels = torch.tensor(args.classes).repeat_interleave(args.per_class)
    else:
        labels = grid_labels(ds.num_classes, args.per_class)
    x = generate(loaded.net, labels, shape=ds.shape, steps=args.steps, guidance=args.guidance, seed=args.seed,
                 device=args.device, sampler=args.sampler, null_label=ds.num_classes, progress=True)
    out = args.out or loaded.checkpoint / f"samples_w{args.guidance:g}_seed{args.seed}.png"
    save_grid(ds.to_images(x), out, per_row=args.per_class)
    print(f"wrote {out} ({len(labels)} samples, step {loaded.step}, guidance {args.guidance:g})")
    return out


if __name__ == "__main__":
    main()
