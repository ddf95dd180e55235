"""FID of a checkpoint or an image folder against reference statistics: `python -m train.fid`.

    # FID-50K of a run's EMA weights against ADM's ImageNet 256 reference batch (mu, sigma in the npz).
    accelerate launch --num_processes 8 -m train.fid --checkpoint runs/X \\
        --ref VIRTUAL_imagenet256_labeled.npz --num-samples 50000 --guidance 1.5
    # Reference statistics of a real image folder, saved once and reused.
    python -m train.fid --images /data/imagenet/val --size 256 --save-stats ref_val256.npz
    # FID between two image folders (or a folder and an npz).
    python -m train.fid --images samples/ --ref ref_val256.npz

Samples are generated in global batches of `batch_size`; batch b uses seed `seed + b` and
class labels (b * batch_size + i) % num_classes (balanced classes), and process r of W
handles the batches b with b % W == r, so the sample set does not depend on the number of
processes. Features are Inception-v3 pool3 (train/inception.py), gathered to every process;
the Fréchet distance is train/frechet.py. The trainer calls `compute_fid` from every process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from routing.errors import ConfigError
from train.cache_latents import IMAGE_EXTENSIONS, center_crop_resize
from train.frechet import feature_statistics, frechet_distance
from train.inception import inception_features, load_inception


@dataclass
class FIDConfig:
    """Settings of one FID evaluation (the trainer's `fid:` config block has these keys)."""

    ref: str  # reference statistics: an .npz with `mu` and `sigma` (ADM layout), or a folder of real images
    num_samples: int = 10_000
    steps: int = 40
    guidance: float = 1.0
    sampler: str = "heun"
    batch_size: int = 64  # samples per global batch; also the Inception batch
    seed: int = 0
    inception: str | None = None  # local weights file; None: torch hub's checkpoints folder


def fid_config(cfg_fid: Any) -> FIDConfig:
    """FIDConfig from a DictConfig / dict (unknown keys, such as the trainer's `every`, are ignored)."""
    from omegaconf import DictConfig, OmegaConf

    values = OmegaConf.to_container(cfg_fid, resolve=True) if isinstance(cfg_fid, DictConfig) else dict(cfg_fid)
    if not values.get("ref"):
        raise ConfigError("fid.ref is not set: pass fid.ref=/path/to/ref.npz (mu, sigma) or a folder of real images.")
    return FIDConfig(**{f.name: values[f.name] for f in fields(FIDConfig) if f.name in values})


def _gather_in_order(accelerator, indices: torch.Tensor, features: torch.Tensor, total: int) -> torch.Tensor:
    """Rows (m, d) with global row ids (m,) on each process -> all rows (total, d) in id order, on every process."""
    indices = accelerator.pad_across_processes(indices.to(accelerator.device), dim=0, pad_index=-1)
    features = accelerator.pad_across_processes(features.to(accelerator.device), dim=0)
    indices, features = accelerator.gather(indices).cpu(), accelerator.gather(features).cpu()
    keep = indices >= 0
    ordered = torch.empty(total, features.shape[1], dtype=features.dtype)
    ordered[indices[keep]] = features[keep]
    return ordered


def list_image_files(folder: Path) -> list[Path]:
    """Image files under folder, recursively, in sorted order."""
    if not folder.is_dir():
        raise ConfigError(f"{str(folder)!r} is not a folder of images.")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if len(files) < 2:
        raise ConfigError(f"{str(folder)!r} holds {len(files)} images; FID needs at least 2.")
    return files


def _load_image(file: Path, size: int | None) -> torch.Tensor:
    with Image.open(file) as image:
        image = image.convert("RGB")
        if size is not None:
            image = center_crop_resize(image, size)
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # (H, W, 3) -> (3, H, W) uint8


def folder_features(folder: Path, extractor, accelerator, batch_size: int, size: int | None = None) -> torch.Tensor:
    """Inception features (n, 2048) of every image in a folder, split across processes."""
    files = list_image_files(folder)
    mine = list(range(accelerator.process_index, len(files), accelerator.num_processes))
    features = []
    for start in tqdm(range(0, len(mine), batch_size), desc="real", disable=not accelerator.is_main_process):
        images = [_load_image(files[i], size) for i in mine[start : start + batch_size]]
        if len({tuple(image.shape) for image in images}) > 1:
            raise ConfigError(f"images in {str(folder)!r} differ in size: pass --size N to centre-crop them to N x N.")
        features.append(inception_features(extractor, torch.stack(images), batch_size))
    local = torch.cat(features) if features else torch.zeros(0, 2048)
    return _gather_in_order(accelerator, torch.tensor(mine, dtype=torch.long), local, len(files))


def reference_statistics(ref: str, extractor, accelerator, batch_size: int, size: int | None = None):
    """(mu, sigma) from an npz (ADM's keys `mu`, `sigma`) or from the images of a folder."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return feature_statistics(folder_features(path, extractor, accelerator, batch_size, size))
    if not path.is_file():
        raise ConfigError(f"FID reference {ref!r} does not exist: pass an .npz with mu and sigma, or an image folder.")
    with np.load(path) as npz:
        if "mu" not in npz or "sigma" not in npz:
            raise ConfigError(f"FID reference {ref!r} has keys {sorted(npz.files)}, not 'mu' and 'sigma'.")
        return npz["mu"].astype(np.float64), npz["sigma"].astype(np.float64)


def sample_features(net, dataset, cfg: FIDConfig, accelerator, extractor) -> torch.Tensor:
    """Inception features (num_samples, 2048) of generated images, gathered to every process."""
    from train.sample import generate

    num_batches = math.ceil(cfg.num_samples / cfg.batch_size)
    mine = range(accelerator.process_index, num_batches, accelerator.num_processes)
    indices, features = [], []
    for b in tqdm(mine, desc="fid samples", disable=not accelerator.is_main_process):
        ids = torch.arange(b * cfg.batch_size, min((b + 1) * cfg.batch_size, cfg.num_samples))
        labels = ids % max(dataset.num_classes, 1)
        x = generate(net, labels, shape=tuple(dataset.shape), steps=cfg.steps, guidance=cfg.guidance, seed=cfg.seed + b,
                     device=accelerator.device, sampler=cfg.sampler, null_label=dataset.num_classes)
        features.append(inception_features(extractor, dataset.to_images(x), cfg.batch_size))
        indices.append(ids)
    local_ids = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.long)
    local = torch.cat(features) if features else torch.zeros(0, 2048, device=accelerator.device)
    return _gather_in_order(accelerator, local_ids, local, cfg.num_samples)


def compute_fid(net, dataset, cfg_fid: Any, accelerator) -> float:
    """FID of `net` (EDM denoiser, eval mode, on accelerator.device) against cfg_fid.ref; call on every process."""
    cfg = fid_config(cfg_fid)
    extractor = load_inception(cfg.inception, accelerator.device)
    generated = sample_features(net, dataset, cfg, accelerator, extractor)
    mu_ref, sigma_ref = _cached_reference(cfg.ref, extractor, accelerator, cfg.batch_size)
    return frechet_distance(*feature_statistics(generated), mu_ref, sigma_ref)


_REFERENCE_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _cached_reference(ref: str, extractor, accelerator, batch_size: int):
    # Periodic FID during training reuses the reference statistics instead of re-reading a folder every time.
    if ref not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[ref] = reference_statistics(ref, extractor, accelerator, batch_size)
    return _REFERENCE_CACHE[ref]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.fid", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="run folder (its latest checkpoint) or checkpoint folder to sample from")
    source.add_argument("--images", help="folder of images to score instead of a checkpoint")
    parser.add_argument("--ref", help="reference: .npz with mu and sigma (e.g. ADM's VIRTUAL_imagenet256_labeled.npz) or an image folder")
    parser.add_argument("--save-stats", help="with --images: write the folder's mu and sigma to this .npz and stop")
    parser.add_argument("--size", type=int, help="centre-crop and resize folder images to this size (real ImageNet folders)")
    parser.add_argument("--inception", help="Inception weights file (default: torch hub's checkpoints folder)")
    defaults = FIDConfig(ref="")
    parser.add_argument("--num-samples", type=int, default=50_000)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="Heun steps")
    parser.add_argument("--guidance", type=float, default=defaults.guidance, help="classifier-free guidance w (1 = off)")
    parser.add_argument("--sampler", default=defaults.sampler, choices=("heun", "euler"))
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", help="JSON file for the result (default: <checkpoint>/fid.json with --checkpoint)")
    args = parser.parse_args(argv)
    if args.save_stats is None and args.ref is None:
        parser.error("--ref is required unless --images and --save-stats are given")
    if args.save_stats is not None and args.images is None:
        parser.error("--save-stats needs --images")
    return args


def main(argv: list[str] | None = None) -> float | None:
    """Run the CLI; returns the FID (None with --save-stats)."""
    from accelerate import Accelerator

    args = parse_args(argv)
    accelerator = Accelerator()
    extractor = load_inception(args.inception, accelerator.device)

    # Reference statistics only: write them and stop.
    if args.save_stats:
        mu, sigma = feature_statistics(folder_features(Path(args.images), extractor, accelerator, args.batch_size, args.size))
        if accelerator.is_main_process:
            np.savez(args.save_stats, mu=mu, sigma=sigma)
            print(f"wrote {args.save_stats} (mu {mu.shape}, sigma {sigma.shape})")
        return None

    # Features of the evaluated images: a folder, or samples from the checkpoint's EMA weights.
    result: dict[str, Any] = {"ref": args.ref}
    if args.images:
        generated = folder_features(Path(args.images), extractor, accelerator, args.batch_size, args.size)
        result["images"] = args.images
        out = args.out
    else:
        from train.sample import load_run

        loaded = load_run(args.checkpoint, accelerator.device)
        cfg = FIDConfig(ref=args.ref, num_samples=args.num_samples, steps=args.steps, guidance=args.guidance,
                        sampler=args.sampler, batch_size=args.batch_size, seed=args.seed, inception=args.inception)
        generated = sample_features(loaded.net, loaded.dataset, cfg, accelerator, extractor)
        result.update(asdict(cfg), checkpoint=str(loaded.checkpoint), step=loaded.step)
        out = args.out or os.fspath(loaded.checkpoint / "fid.json")

    mu_ref, sigma_ref = reference_statistics(args.ref, extractor, accelerator, args.batch_size, args.size)
    fid = frechet_distance(*feature_statistics(generated), mu_ref, sigma_ref)
    if accelerator.is_main_process:
        result.update(fid=fid, num_images=len(generated))
        print(f"FID {fid:.4f} ({len(generated)} images vs {args.ref})")
        if out:
            Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return fid


if __name__ == "__main__":
    from train.cli import friendly_errors

    friendly_errors(main)()
