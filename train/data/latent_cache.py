"""Encode an image folder into cached VAE latents (the logic behind `python -m train.cache_latents`).

Reads ImageNet-layout folders (one subfolder per class, class names sorted -> label ids) or a
flat folder plus a `filename,label` CSV, centre-crops and resizes every image the ADM way,
optionally adds a horizontally flipped copy, encodes with a diffusers AutoencoderKL and writes
the posterior mean and std (UNSCALED: multiply by meta.json's scaling_factor to get the usual
SD latents) in safetensors shards. The format is documented in docs/latents.md.

Resumable and parallel: shard k holds source images [k * shard_size, (k + 1) * shard_size);
under `accelerate launch` process r encodes the shards with k % world_size == r, each shard is
written atomically (temp file + os.replace), and finished shards are skipped on a re-run.
After all processes finish, the main process writes meta.json (complete=true) and stats.json
from the per-shard sums stored in every shard's header. Unreadable images are skipped, counted
and listed in meta.json.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from routing.errors import ConfigError
from train.data.images import IMAGE_EXTENSIONS, center_crop_resize, list_images
from train.data.latents import DEFAULT_VAE, load_vae, shard_name, spatial_factor
from train.files import damaged, read_json, safetensors_metadata, tensor_shapes, write_atomic

FORMAT_VERSION = 1
# Settings that must match between a run and the folder it resumes.
_PLAN_KEYS = ("format_version", "images", "vae", "image_size", "flip", "shard_size", "num_files", "storage_dtype", "align")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# What PIL raises for truncated, corrupt or hostile files; any of them means "skip this image".
_UNREADABLE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


@dataclass
class AlignInputs:
    """What align=repa needs beside each latent, stored in the same shard row (docs/alignment.md): the image itself at
    `image_size` pixels (uint8 `align_images`, for an encoder run at training time), and/or the frozen encoder's patch
    features (fp16 `align_features`, on the encoder's own patch grid) from `encode`, which the command builds."""

    image_size: int = 0
    # device -> (encode, how): encode maps pixels (n, 3, H, W) in [-1, 1] on the device to (n, gh*gw, C) features; how
    # records encoder, weights, input_size, grid and dim. Called once the process knows its device (`prepare`).
    load_encoder: Callable | None = None
    encode: Callable | None = None
    features: dict = field(default_factory=dict)

    def prepare(self, device: torch.device) -> None:
        if self.load_encoder is not None and self.encode is None:
            self.encode, self.features = self.load_encoder(device)

    def plan(self) -> dict | None:
        """meta.json's `align` (and the resume check's): what each shard holds, None for nothing."""
        plan = ({"images": self.image_size} if self.image_size else {}) | ({"features": self.features} if self.encode else {})
        return plan or None

    def __call__(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        if self.image_size:
            side = (self.image_size, self.image_size)
            images = pixels.float()
            if images.shape[-2:] != side:  # (n, 3, H, W) -> (n, 3, S, S)
                images = torch.nn.functional.interpolate(images, size=side, mode="bicubic", align_corners=False, antialias=True)
            out["align_images"] = ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu()
        if self.encode is not None:
            out["align_features"] = self.encode(pixels).to(torch.float16).cpu()
        return out


@dataclass
class CacheSettings:
    """What to encode and how; `python -m train.cache_latents --help` describes each field."""

    images: str
    out: str
    labels_file: str | None = None
    vae: str = DEFAULT_VAE
    size: int = 256
    flip: bool = False
    shard_size: int = 4096
    batch_size: int = 64
    num_workers: int = 4
    storage_dtype: str = "float16"
    encode_dtype: str = "float32"
    align: AlignInputs = field(default_factory=AlignInputs)


class _ImageFiles(Dataset):
    """Item i: the i-th image as (copies, 3, size, size) in [-1, 1], or None when unreadable."""

    def __init__(self, root: Path, files: list[str], size: int, flip: bool):
        self.root, self.files, self.size, self.flip = root, files, size, flip

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None]:
        try:
            with Image.open(self.root / self.files[index]) as image:
                image = center_crop_resize(image.convert("RGB"), self.size)
        except _UNREADABLE:
            return index, None
        pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # (H, W, 3) -> (3, H, W)
        pixels = pixels.float() / 127.5 - 1
        copies = [pixels, pixels.flip(-1)] if self.flip else [pixels]
        return index, torch.stack(copies)


def _collate(batch: list[tuple[int, torch.Tensor | None]]) -> dict:
    readable = [(i, x) for i, x in batch if x is not None]
    return {
        "indices": [i for i, _ in readable],
        "images": torch.cat([x for _, x in readable]) if readable else None,  # (n * copies, 3, H, W)
        "failed": [i for i, x in batch if x is None],
    }


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors shard atomically, so a crash or a full disk never leaves a half shard that looks finished."""
    contiguous = {name: t.contiguous() for name, t in tensors.items()}
    write_atomic(path, lambda tmp: save_file(contiguous, str(tmp), metadata=metadata))


def _check_plan(out: Path, plan: dict) -> None:
    """Refuse to resume into a folder cached with different settings."""
    meta_file = out / "meta.json"
    if not meta_file.exists():
        return
    fix = "delete it to start this folder afresh, or choose a new --out folder"
    previous = read_json(meta_file, fix)
    if not isinstance(previous, dict):
        raise damaged(meta_file, "does not hold a JSON object", fix)
    for key in _PLAN_KEYS:
        if previous.get(key) != plan[key]:
            raise ConfigError(
                f"--out {str(out)!r} holds latents cached with {key}={previous.get(key)!r}, not {plan[key]!r}: "
                f"use the same settings to resume, or a new --out folder."
            )


def _encode_shards(args: CacheSettings, accelerator, vae, files, labels, shard_ids, out: Path) -> None:
    """Encode and write the given shards on this process."""
    copies = 2 if args.flip else 1
    storage = DTYPES[args.storage_dtype]
    label_ids = torch.tensor(labels, dtype=torch.int64)

    # One batch never crosses a shard boundary, so a shard is complete when its last batch arrives.
    batches, batch_shard = [], []
    for k in shard_ids:
        end = min((k + 1) * args.shard_size, len(files))
        for start in range(k * args.shard_size, end, args.batch_size):
            batches.append(list(range(start, min(start + args.batch_size, end))))
            batch_shard.append(k)
    last_batch = {k: i for i, k in enumerate(batch_shard)}
    loader = DataLoader(
        _ImageFiles(Path(args.images), files, args.size, args.flip),
        batch_sampler=batches,
        num_workers=args.num_workers,
        collate_fn=_collate,
    )

    progress = tqdm(
        total=sum(len(b) for b in batches), unit="img", desc="encode", disable=not accelerator.is_local_main_process
    )
    parts: dict[str, list] = {"mean": [], "std": [], "labels": [], "failed": []}
    # Empty rows of each align tensor, for a shard whose every image is unreadable.
    empty = {k: v[:0] for k, v in args.align(torch.zeros(1, 3, args.size, args.size, device=accelerator.device)).items()}
    skipped = 0
    for i, batch in enumerate(loader):
        k = batch_shard[i]
        parts["failed"] += [files[j] for j in batch["failed"]]
        skipped += len(batch["failed"])
        if batch["images"] is not None:
            with torch.no_grad():
                posterior = vae.encode(batch["images"].to(accelerator.device, vae.dtype)).latent_dist
            parts["mean"].append(posterior.mean.float().cpu())
            parts["std"].append(posterior.std.float().cpu())
            parts["labels"].append(label_ids[batch["indices"]].repeat_interleave(copies))
            with torch.no_grad():
                for name, rows in args.align(batch["images"].to(accelerator.device)).items():
                    parts.setdefault(name, []).append(rows)
        progress.update(len(batches[i]))
        progress.set_postfix(skipped=skipped, shard=k)
        if i == last_batch[k]:
            aligned = {name: torch.cat(parts.get(name) or [rows]) for name, rows in empty.items()}
            _finish_shard(out / shard_name(k), parts, vae, args.size, storage, aligned)
            parts = {"mean": [], "std": [], "labels": [], "failed": []}
    progress.close()


def _finish_shard(path: Path, parts: dict, vae, size: int, storage: torch.dtype, aligned: dict[str, torch.Tensor]) -> None:
    channels = vae.config.latent_channels
    if parts["mean"]:
        mean, std, labels = torch.cat(parts["mean"]), torch.cat(parts["std"]), torch.cat(parts["labels"])
    else:
        # Every image of this shard was unreadable: an empty shard keeps the numbering simple.
        latent_size = size // spatial_factor(vae.config)
        mean = std = torch.zeros(0, channels, latent_size, latent_size)
        labels = torch.zeros(0, dtype=torch.int64)
    mean, std = mean.to(storage), std.to(storage)
    # Per-channel sums over (n, h, w) of the stored values, in float64, for stats.json: E[mean], E[mean^2], E[std^2].
    sums = {
        "sum_mean": mean.double().sum((0, 2, 3)),
        "sum_mean_sq": mean.double().square().sum((0, 2, 3)),
        "sum_var": std.double().square().sum((0, 2, 3)),
    }
    metadata = {name: json.dumps(value.tolist()) for name, value in sums.items()}
    metadata["values_per_channel"] = str(mean.numel() // channels)
    metadata["scaling_factor"] = repr(float(vae.config.scaling_factor))
    # Flux's and SD3's VAEs also shift: their transformers see (z - shift_factor) * scaling_factor.
    metadata["shift_factor"] = repr(float(getattr(vae.config, "shift_factor", None) or 0.0))
    metadata["skipped"] = json.dumps(parts["failed"])
    _write_shard(path, {"mean": mean, "std": std, "labels": labels, **aligned}, metadata)


REDO_SHARD = "delete it and run the same command again, which rewrites missing shards"


def _write_summary(out: Path, plan: dict, num_shards: int) -> dict:
    """meta.json (complete) and stats.json from the headers of all shards."""
    shards, skipped, scaling_factors, shift_factors = [], [], set(), set()
    sums = {"sum_mean": 0.0, "sum_mean_sq": 0.0, "sum_var": 0.0}
    values = 0
    latent_shape = None
    for k in range(num_shards):
        path = out / shard_name(k)
        metadata, shapes = safetensors_metadata(path, REDO_SHARD), tensor_shapes(path, REDO_SHARD)
        try:
            count = shapes["labels"][0]
            if count:
                latent_shape = list(shapes["mean"][1:])
            skipped += json.loads(metadata["skipped"])
            scaling_factors.add(float(metadata["scaling_factor"]))
            shift_factors.add(float(metadata.get("shift_factor", 0.0)))
            values += int(metadata["values_per_channel"])
            for name in sums:
                sums[name] = sums[name] + np.array(json.loads(metadata[name]))
        except (KeyError, IndexError, ValueError, TypeError):  # a shard this command did not write
            raise damaged(path, "is not a shard of this cache (tensors or header entries missing)", REDO_SHARD) from None
        shards.append({"file": shard_name(k), "count": count})
    if latent_shape is None:
        raise ConfigError(f"--images {plan['images']!r}: no image could be read, nothing was cached.")

    # Statistics of the scaled training samples z = s * (mean + std * eps): Var = s^2 (Var[mean] + E[std^2]).
    (scaling_factor,), (shift_factor,) = scaling_factors, shift_factors
    s = scaling_factor
    channel_mean = sums["sum_mean"] / values
    channel_var = sums["sum_mean_sq"] / values - channel_mean**2 + sums["sum_var"] / values
    stats = {
        "of": "scaled posterior samples z = scaling_factor * (mean + std * eps), per channel",
        "mean": (s * channel_mean).tolist(),
        "std": (s * np.sqrt(channel_var)).tolist(),
        "count": values,
    }
    meta = dict(
        plan,
        complete=True,
        latent_shape=list(latent_shape),
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        num_latents=sum(shard["count"] for shard in shards),
        shards=shards,
        skipped={"count": len(skipped), "files": skipped},
    )
    write_atomic(out / "stats.json", json.dumps(stats, indent=2) + "\n")
    write_atomic(out / "meta.json", json.dumps(meta, indent=2) + "\n")  # last: complete=true only once stats.json is whole
    return meta


def cache_latents(args: CacheSettings) -> dict | None:
    """Encode `args.images` into shards under `args.out`; returns meta.json's content on the main process."""
    from accelerate import Accelerator

    # On a machine without a GPU, `accelerate launch --multi_gpu --num_processes N` starts N processes that join one
    # gloo group only if the Accelerator is asked for the CPU; a plain one makes each a lone process encoding every shard.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    args.align.prepare(accelerator.device)  # before the plan, which records the encoder's patch grid and width
    images, out = Path(args.images).expanduser().resolve(), Path(args.out).expanduser()
    if not images.is_dir():
        raise ConfigError(f"--images {args.images!r} is not a folder.")
    vae = str(Path(args.vae).expanduser().resolve()) if Path(args.vae).expanduser().is_dir() else args.vae
    args.images, args.vae = str(images), vae

    # List the images and check the plan against what the folder already holds.
    files, labels, class_names = list_images(images, Path(args.labels_file) if args.labels_file else None)
    if not files:
        raise ConfigError(f"--images {args.images!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}).")
    plan = {
        "format_version": FORMAT_VERSION,
        "images": args.images,
        "vae": args.vae,
        "image_size": args.size,
        "flip": args.flip,
        "shard_size": args.shard_size,
        "num_files": len(files),
        "storage_dtype": args.storage_dtype,
        "num_classes": len(class_names),
        "class_names": class_names,
        "align": args.align.plan(),
    }
    _check_plan(out, plan)

    # Find this process's unfinished shards and load the VAE before anything is written.
    num_shards = math.ceil(len(files) / args.shard_size)
    mine = [k for k in range(num_shards) if k % accelerator.num_processes == accelerator.process_index]
    todo = [k for k in mine if not (out / shard_name(k)).is_file()]
    for k in sorted(set(mine) - set(todo)):  # finished shards whole (a copy cut short), before anything is written
        tensor_shapes(out / shard_name(k), REDO_SHARD)
    if accelerator.is_local_main_process:
        print(f"cache_latents: {len(files)} images, {num_shards} shards; {len(mine) - len(todo)} of this process's "
              f"{len(mine)} shards already done.", file=sys.stderr)
    vae = load_vae(args.vae, device=accelerator.device, dtype=DTYPES[args.encode_dtype]) if todo else None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "meta.json", json.dumps(dict(plan, complete=False), indent=2) + "\n")
    accelerator.wait_for_everyone()

    # Encode them.
    if todo:
        _encode_shards(args, accelerator, vae, files, labels, todo, out)

    # Summarise on the main process once every process has written its shards.
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return None
    meta = _write_summary(out, plan, num_shards)
    print(
        f"cache_latents: {meta['num_latents']} latents {meta['latent_shape']} in {num_shards} shards at {out}; "
        f"skipped {meta['skipped']['count']} unreadable images (listed in meta.json).",
        file=sys.stderr,
    )
    return meta


