"""`python -m train.sample RUN_OR_CHECKPOINT`: sample a class-conditional image grid from EMA weights.

    python -m train.sample runs/2026-11-22_10-00-00 --guidance 2 --steps 40 --seed 0 --out grid.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from edm import generate
from routing import ConfigError
from train.checkpoint import load_run
from train.cli import friendly_errors
from train.grid import grid_labels, save_grid


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
