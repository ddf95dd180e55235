"""FID of a checkpoint or an image folder against reference statistics: `python -m train.fid`.

    # FID-50K of a run's EMA weights against ADM's ImageNet 256 reference batch (mu, sigma in the npz).
    accelerate launch --num_processes 8 -m train.fid --checkpoint runs/X \\
        --ref VIRTUAL_imagenet256_labeled.npz --num-samples 50000 --guidance 1.5
    # Reference statistics of a real image folder, saved once and reused.
    python -m train.fid --images /data/imagenet/val --size 256 --save-stats ref_val256.npz
    # FID between two image folders (or a folder and an npz).
    python -m train.fid --images samples/ --ref ref_val256.npz

The computation (sampling order, feature gathering, the Fréchet distance) is train/metrics/fid.py.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from routing import ConfigError
from train.build import objective_name
from train.checkpoint import load_run
from train.cli import ArgumentParser, add_sampling_rule_flags, bounded, check_sampling_rule_flags, existing, friendly_errors, writable_file
from train.files import write_atomic
from train.metrics.fid import FIDConfig, check_reference, folder_features, reference_statistics, sample_features
from train.metrics.frechet import feature_statistics, frechet_distance
from train.metrics.inception import load_inception, resolve_weights


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m train.fid", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=existing("checkpoint"), help="run folder (its latest checkpoint) or checkpoint folder to sample from")
    source.add_argument("--images", type=existing("image folder"), help="folder of images to score instead of a checkpoint")
    parser.add_argument("--pretrained", help="with --checkpoint of a fine-tuning run: its base model folder, where it lives "
                        "now if it moved (default: the run's finetune.pretrained)")
    parser.add_argument("--ref", type=existing("reference"), help="reference: .npz with mu and sigma (e.g. ADM's VIRTUAL_imagenet256_labeled.npz) or an image folder")
    parser.add_argument("--save-stats", type=writable_file, help="with --images: write the folder's mu and sigma to this .npz and stop")
    parser.add_argument("--size", type=bounded(int, 8, 4096, example="--size 256"), help="centre-crop and resize folder images to this size (real ImageNet folders)")
    parser.add_argument("--inception", type=existing("Inception weights file"), help="Inception weights file (default: torch hub's checkpoints folder)")
    defaults = FIDConfig(ref="")
    parser.add_argument("--num-samples", type=bounded(int, 2, example="--num-samples 50000"), default=50_000)
    parser.add_argument("--steps", type=bounded(int, 1, example="--steps 40"), default=defaults.steps, help="Heun steps")
    parser.add_argument("--guidance", type=bounded(float, 0, 100, example="--guidance 1.5"), default=defaults.guidance, help="classifier-free guidance w (1 = off)")
    parser.add_argument("--sampler", default=defaults.sampler, choices=("heun", "euler"))
    parser.add_argument("--batch-size", type=bounded(int, 1, example="--batch-size 64"), default=defaults.batch_size)
    parser.add_argument("--seed", type=bounded(int, 0, example="--seed 0"), default=defaults.seed)
    parser.add_argument("--objective", choices=("edm", "flow"), help="refuse the checkpoint unless it was trained with this objective")
    add_sampling_rule_flags(parser, defaults.route_ratio, defaults.rg_scale, defaults.rg_gamma2)
    parser.add_argument("--out", type=writable_file, help="JSON file for the result (default: <checkpoint>/fid.json with --checkpoint)")
    args = parser.parse_args(argv)
    if args.save_stats is None and args.ref is None:
        parser.error("--ref is required unless --images and --save-stats are given")
    if args.save_stats is not None and args.images is None:
        parser.error("--save-stats needs --images")
    check_sampling_rule_flags(parser, args)
    return args


def main(argv: list[str] | None = None) -> float | None:
    """Run the CLI; returns the FID (None with --save-stats)."""
    from accelerate import Accelerator

    args = parse_args(argv)
    # Every file is checked before the Inception network loads and before any sample is drawn: the reference
    # (size, NaN), the weights file, the checkpoint.
    if args.ref is not None:
        check_reference(args.ref, args.inception)
    resolve_weights(args.inception)
    # Without a GPU, `accelerate launch --multi_gpu --num_processes N` makes one gloo group only for an Accelerator
    # asked for the CPU; a plain one would make N lone processes, each scoring every image.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    loaded = None
    if args.checkpoint:
        loaded = load_run(args.checkpoint, accelerator.device, args.pretrained)
        if len(loaded.dataset.shape) != 3:
            raise ConfigError(f"checkpoint '{loaded.checkpoint}' generates videos, which FID (Inception on images) does not score; "
                              "sample them with python -m train.sample instead.")
        trained = objective_name(loaded.cfg)
        if args.objective and args.objective != trained:
            raise ConfigError(f"checkpoint '{loaded.checkpoint}' was trained with objective={trained}, not --objective "
                              f"{args.objective}; drop the flag or pass --objective {trained}.")
    extractor = load_inception(args.inception, accelerator.device)

    # Reference statistics only: write them and stop.
    if args.save_stats:
        mu, sigma = feature_statistics(folder_features(Path(args.images), extractor, accelerator, args.batch_size, args.size))
        if accelerator.is_main_process:
            npz = io.BytesIO()
            np.savez(npz, mu=mu, sigma=sigma)
            write_atomic(args.save_stats, npz.getvalue())
            print(f"wrote {args.save_stats} (mu {mu.shape}, sigma {sigma.shape})")
        return None

    # Reference statistics first (a folder of real images is read once, before hours of sampling), then the
    # features of the evaluated images: a folder, or samples from the checkpoint's EMA weights.
    mu_ref, sigma_ref = reference_statistics(args.ref, extractor, accelerator, args.batch_size, args.size)
    result: dict[str, Any] = {"ref": args.ref, "processes": accelerator.num_processes}
    if args.images:
        generated = folder_features(Path(args.images), extractor, accelerator, args.batch_size, args.size)
        result["images"] = args.images
        out = args.out
    else:
        cfg = FIDConfig(**{f.name: getattr(args, f.name) for f in fields(FIDConfig)})
        generated = sample_features(loaded.net, loaded.dataset, cfg, accelerator, extractor, loaded.objective)
        result.update(asdict(cfg), checkpoint=str(loaded.checkpoint), step=loaded.step)
        out = args.out or os.fspath(loaded.checkpoint / "fid.json")

    fid = frechet_distance(*feature_statistics(generated), mu_ref, sigma_ref)
    if accelerator.is_main_process:
        result.update(fid=fid, num_images=len(generated))
        print(f"FID {fid:.4f} ({len(generated)} images vs {args.ref})")
        if out:
            write_atomic(out, json.dumps(result, indent=2) + "\n")
    return fid


if __name__ == "__main__":
    friendly_errors(main)()
