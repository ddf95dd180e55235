"""Encode an image folder into cached VAE latents: `python -m train.cache_latents`.

    accelerate launch --num_processes 8 -m train.cache_latents \\
        --images /data/imagenet/train --out /data/latents/in256 --vae /weights/sd-vae-ft-ema --flip

The encoding, its resumable shard layout and its statistics live in train/data/latent_cache.py.
For align=repa on these latents (docs/alignment.md), store what its encoder needs beside each latent:
--align-images 224 (the images, uint8; the encoder runs while training), or --align-encoder NAME
--align-weights FILE [--align-input-size 224] (the encoder's patch features, fp16; no encoder while training).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from train.cli import ArgumentParser, bounded, existing, friendly_errors, output_folder
from routing import ConfigError
from train.data.images import list_images
from train.data.latent_cache import DTYPES, AlignInputs, CacheSettings, cache_latents
from train.data.latents import DEFAULT_VAE, vae_factor


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m train.cache_latents", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", required=True, type=existing("image folder"), help="image folder: one subfolder per class, or flat with --labels-file")
    parser.add_argument("--out", required=True, type=output_folder, help="output folder for shards, meta.json and stats.json")
    parser.add_argument("--labels-file", default=None, type=existing("labels file"), help="CSV of `filename,label` rows for a flat folder")
    parser.add_argument("--vae", default=DEFAULT_VAE, help="diffusers AutoencoderKL: local folder (offline) or hub id")
    parser.add_argument("--size", type=bounded(int, 8, 4096, example="--size 256"), default=256, help="image size after centre crop and resize")
    parser.add_argument("--flip", action="store_true", help="also store a horizontally flipped copy of every image")
    parser.add_argument("--shard-size", type=bounded(int, 1, example="--shard-size 4096"), default=4096, help="source images per shard")
    parser.add_argument("--batch-size", type=bounded(int, 1, example="--batch-size 64"), default=64, help="images per VAE forward, per process")
    parser.add_argument("--num-workers", type=bounded(int, 0, 256, example="--num-workers 4"), default=4, help="image decoding workers per process")
    parser.add_argument("--storage-dtype", choices=("float16", "float32"), default="float16")
    parser.add_argument("--encode-dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--align-images", type=bounded(int, 8, 4096, example="--align-images 224"), default=0, metavar="SIZE",
                        help="also store each image at SIZE pixels (uint8) for align=repa's encoder")
    parser.add_argument("--align-encoder", default=None, metavar="NAME", help="also store this timm encoder's patch features (fp16) for align=repa")
    parser.add_argument("--align-weights", default=None, type=existing("encoder weights"), metavar="PATH",
                        help="local weights of --align-encoder (a .safetensors or .pth state dict, or a timm folder); never downloaded")
    parser.add_argument("--align-input-size", type=bounded(int, 8, 4096, example="--align-input-size 224"), default=224, metavar="SIZE",
                        help="pixels the encoder sees (default 224)")
    args = parser.parse_args(argv)
    if (args.align_encoder is None) != (args.align_weights is None):
        parser.error("--align-encoder and --align-weights go together: name the timm encoder and its local weights file")
    return args


def align_inputs(args: argparse.Namespace) -> AlignInputs:
    """What to store for align=repa; the encoder (if any) loads on each process's device once accelerate gives it."""
    if args.align_encoder is None:
        return AlignInputs(image_size=args.align_images)
    from train.metrics.encoder import FrozenEncoder

    weights = str(Path(args.align_weights).expanduser().resolve())

    def load(device):
        encoder = FrozenEncoder.load(args.align_encoder, weights, args.align_input_size, None, device)
        return encoder, {"encoder": args.align_encoder, "weights": weights, "input_size": args.align_input_size,
                         "grid": list(encoder.grid), "dim": encoder.dim}

    return AlignInputs(image_size=args.align_images, load_encoder=load)


def check_labels_file(images: Path, labels_file: Path) -> None:
    """Refuse a labels file with a row whose image is not in the folder (a typo, a path not relative to --images):
    the cache would hold fewer images than the file lists, or fail minutes into encoding."""
    root = images.expanduser().resolve()
    files, _, _ = list_images(root, labels_file)
    missing = [f for f in files if not (root / f).resolve().is_relative_to(root) or not (root / f).is_file()]
    if missing:
        raise ConfigError(f"--labels-file {str(labels_file)!r} names {len(missing)} file(s) that are not in --images "
                          f"{str(images)!r} (first: {missing[0]!r}); write each path relative to --images, or drop those rows.")


# The smallest patch of every model that trains on latents: the backbones' patch_size and the adapters' (Flux packs
# 2x2 latent pixels into a token), so a latent side must be even.
SMALLEST_PATCH = 2


def check_size(size: int, vae: str) -> None:
    """Refuse an image size whose latents no model could split into patches (15 px: 7 x 7 latents), before the VAE
    loads and anything is written."""
    factor = vae_factor(vae)
    step = factor * SMALLEST_PATCH
    if size % step:
        near = " or ".join(f"--size {n}" for n in (size - size % step, size - size % step + step) if n >= step)
        raise ConfigError(f"--size {size} is not a multiple of {step} (the VAE's factor {factor} x the smallest patch "
                          f"{SMALLEST_PATCH}), so its latents would not split into a model's patches; use {near}.")


def main(argv: Sequence[str] | None = None) -> dict | None:
    """Run the caching; returns meta.json's content on the main process."""
    args = parse_args(argv)
    check_size(args.size, args.vae)
    if args.labels_file and Path(args.images).expanduser().is_dir():
        check_labels_file(Path(args.images), Path(args.labels_file))
    settings = {k: v for k, v in vars(args).items() if not k.startswith("align_")}
    return cache_latents(CacheSettings(**{**settings, "out": str(args.out)}, align=align_inputs(args)))


if __name__ == "__main__":
    friendly_errors(main)()
