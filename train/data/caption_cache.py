"""The cache of a captioned folder: its captions encoded by the pipeline's own text encoders, its images encoded by
the pipeline's VAE, one file per aspect-ratio bucket; `prepare_captions` writes it, `CaptionsDataset` reads it.

Layout of the cache folder (data.cache, default `<data.path>/.tread_cache`):
- `manifest.json`: the images (relative path, caption row, bucket), the distinct captions, the buckets, the
  latent space (VAE factors, or pixels), and the key of every file below;
- `text.safetensors`: a prompt table (train/data/prompts.py) with one row per distinct caption and the empty
  caption last, encoded with the pipeline's `encode_prompt`;
- `latents-<W>x<H>.safetensors`: the VAE posterior (`mean`, `std`, unscaled) of the bucket's images, in
  manifest order (pixels in [-1, 1] as `mean` with `std` 0 when data.vae=pixels).

Each file is rewritten only when its key changes: the text when the captions, the encoders (their configs,
tokenizer files, and the size and time of their weights) or the sequence length change; a bucket when the VAE,
the bucket's size or any of its images (path, size, time) change. Every file is written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from routing.errors import ConfigError
from train.data.buckets import bucket_sizes, fit_to_bucket, nearest_bucket
from train.data.captions import UNREADABLE, list_captioned
from train.data.latents import spatial_factor
from train.data.prompts import encode_table, read_table, write_table
from train.files import read_config, write_atomic
from train.files.atomic import stale_temporaries

FORMAT = "tread-zoo-captions/1"
MANIFEST, TEXT = "manifest.json", "text.safetensors"
PIXELS = "pixels"  # data.vae: train on the images themselves (tiny CPU models without a VAE)
SMALL_FILES = (".json", ".txt", ".model")  # hashed whole; weights are identified by size and time


def cache_folder(cfg_data) -> Path:
    return Path(str(cfg_data.cache)).expanduser() if cfg_data.get("cache") else Path(str(cfg_data.path)).expanduser() / ".tread_cache"


# What each captioned data kind needs from its pipeline folder, named in the refusals: (the folders, the VAE class, an example).
NEEDS = {"captions": ("text_encoder*/ and tokenizer*/", "AutoencoderKL", "black-forest-labs/FLUX.1-dev"),
         "videos": ("text_encoder/, tokenizer/ and vae/", "AutoencoderKLWan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")}


def pipeline_folder(cfg) -> Path:
    """The pipeline whose text encoders (and VAE) encode the data: data.pipeline, else finetune.pretrained."""
    folder = Path(str(cfg.data.get("pipeline") or cfg.finetune.pretrained)).expanduser()
    key = "data.pipeline" if cfg.data.get("pipeline") else "finetune.pretrained"
    if not (folder / "model_index.json").is_file():
        folders, _, example = NEEDS[cfg.data.name]
        raise ConfigError(f"data={cfg.data.name} encodes the captions with the pipeline's own text encoders, but {key}='{folder}' is "
                          f"not a diffusers pipeline folder (no model_index.json); point data.pipeline at one with {folders} "
                          f"(e.g. `huggingface-cli download {example} --local-dir weights/{example.split('/')[1]}`).")
    return folder


def vae_folder(cfg) -> Path | None:
    """The VAE of the latents: data.vae, else the pipeline's vae/; None for data.vae=pixels."""
    if cfg.data.get("vae") == PIXELS:
        return None
    folder = Path(str(cfg.data.vae)).expanduser() if cfg.data.get("vae") else pipeline_folder(cfg) / "vae"
    if not (folder / "config.json").is_file():
        raise ConfigError(f"data={cfg.data.name} needs a VAE to encode its data, but '{folder}' holds no diffusers "
                          f"{NEEDS[cfg.data.name][1]} (config.json); give data.vae=<its folder>, or data.vae=pixels to train on the "
                          "pixels themselves.")
    return folder


def identity(folders: list[Path]) -> str:
    """A digest of model folders: small files by content, weights by name, size and modification time."""
    digest = hashlib.sha256()
    for folder in folders:
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(folder.parent)).encode())
            if file.suffix in SMALL_FILES:
                digest.update(file.read_bytes())
            else:
                stat = file.stat()
                digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _key(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _text_encoders(pipeline: Path) -> list[Path]:
    return [pipeline / "model_index.json"] + sorted(p for p in pipeline.iterdir() if p.is_dir() and p.name.startswith(("text_encoder", "tokenizer")))


def prepare_captions(cfg, device: str | torch.device = "cpu", log=print, items=None, stage: Path | None = None) -> Path:
    """List data.path (unless `items`, its listing, is given), then (re)write whatever part of the cache is out of
    date; returns the folder to read the cache from. Every refusal (the pipeline, the VAE, a bucket) comes before the
    first write. With `stage` (an empty folder outside the data folder) the cache is not touched: the new or changed
    files go to `stage` beside links to the unchanged ones, and `publish` copies them in once every check of the run
    has passed; returns `stage`, or the cache when nothing changed."""
    d, family = cfg.data, cfg.finetune.family
    items = list_captioned(d.path) if items is None else items
    buckets = bucket_sizes(d.resolution, d.alignment, list(d.aspect_ratios))
    bucket_of = [nearest_bucket(item.size, buckets) for item in items]
    used = sorted(set(bucket_of))
    buckets, bucket_of = [buckets[b] for b in used], [used.index(b) for b in bucket_of]  # only buckets with images
    captions = sorted({item.caption for item in items})
    pipeline, vae_dir = pipeline_folder(cfg), vae_folder(cfg)
    space = {"kind": PIXELS, "channels": d.channels, "factor": 1, "scaling_factor": 1.0, "shift_factor": 0.0}
    if vae_dir is not None:
        config = read_config(vae_dir / "config.json")
        space = {"kind": "vae", "identity": identity([vae_dir]), "factor": spatial_factor(config),
                 "channels": config["latent_channels"], "scaling_factor": float(config.get("scaling_factor") or 1.0),
                 "shift_factor": float(config.get("shift_factor") or 0.0)}
    for size in buckets:
        if size[0] % space["factor"] or size[1] % space["factor"]:
            raise ConfigError(f"bucket {size[0]}x{size[1]} is not a multiple of the VAE's factor {space['factor']}; set data.alignment "
                              f"to a multiple of {space['factor']} (times the model's patch).")
    cache = cache_folder(d)
    out = stage or cache  # where new files go
    old = read_json(cache / MANIFEST)
    if stage is None:
        out.mkdir(parents=True, exist_ok=True)
        clean(cache)

    # Text: the pipeline's own encoders, once for every distinct caption and the empty one.
    text_key = _key({"family": family, "encoders": identity(_text_encoders(pipeline)), "captions": captions,
                     "max_sequence_length": d.max_sequence_length, "dtype": cfg.finetune.dtype})
    if old.get("text_key") != text_key or not (cache / TEXT).is_file():
        log(f"data=captions: encoding {len(captions)} distinct captions with the text encoders of {pipeline}")
        table = encode_table(family, pipeline, captions, device=str(device), dtype=cfg.finetune.dtype,
                             max_sequence_length=d.max_sequence_length)
        write_table(table, out / TEXT)

    # Latents: per bucket, with the VAE's posterior (or the pixels).
    vae = None
    latent_keys = {}
    for b, size in enumerate(buckets):
        members = [i for i, bb in enumerate(bucket_of) if bb == b]
        name = f"latents-{size[0]}x{size[1]}.safetensors"
        latent_keys[name] = _key({"space": space, "size": size, "files": [(items[i].file, items[i].stamp) for i in members]})
        if old.get("latent_keys", {}).get(name) == latent_keys[name] and (cache / name).is_file():
            continue
        if vae_dir is not None and vae is None:
            from diffusers import AutoencoderKL

            vae = AutoencoderKL.from_pretrained(vae_dir, local_files_only=True).to(device).eval().requires_grad_(False)
        log(f"data=captions: encoding {len(members)} images of bucket {size[0]}x{size[1]}"
            f"{' with the VAE in ' + str(vae_dir) if vae is not None else ' (pixels)'}")
        mean, std = _encode_bucket(Path(str(d.path)).expanduser(), [items[i].file for i in members], size, vae, space, device)
        save_atomic(out / name, {"mean": mean, "std": std})

    manifest = {
        "format": FORMAT, "family": family, "files": [item.file for item in items], "captions": captions,
        "labels": [captions.index(item.caption) for item in items], "buckets": [list(s) for s in buckets], "bucket_of": bucket_of,
        "space": space, "vae": str(vae_dir.resolve()) if vae_dir is not None else None, "text_key": text_key, "latent_keys": latent_keys, "source": str(Path(str(d.path)).expanduser().resolve()),
    }
    if json.loads(json.dumps(manifest)) != old:  # written only when it changes, as the files it lists are
        write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return out if stage is None else staged(stage, cache, [MANIFEST, TEXT, *latent_keys])


def staged(stage: Path, cache: Path, names: list[str]) -> Path:
    """`stage` completed with links to the cache's files of `names` it did not rewrite; the cache itself when `stage`
    holds no new file (nothing to publish)."""
    if not any(stage.iterdir()):
        return cache
    for name in names:
        if not (stage / name).exists() and (cache / name).is_file():
            os.symlink((cache / name).resolve(), stage / name)
    return stage


def publish(stage: Path, cache: Path) -> list[str]:
    """Copy the files `prepare_captions` or `prepare_videos` wrote into `stage` (not its links) into the cache, each
    atomically and the manifest last, so the cache never lists a file it lacks; returns their names."""
    new = sorted((p for p in stage.iterdir() if p.is_file() and not p.is_symlink()), key=lambda p: (p.name == MANIFEST, p.name))
    if new:
        cache.mkdir(parents=True, exist_ok=True)
        clean(cache)
    for file in new:
        write_atomic(cache / file.name, lambda tmp, file=file: shutil.copyfile(file, tmp))
    return [p.name for p in new]


def clean(cache: Path) -> None:
    """Remove the temporary files that a killed write left in the cache (their process no longer runs)."""
    for tmp in stale_temporaries(cache, pid_last=True):
        tmp.unlink(missing_ok=True)


@torch.no_grad()
def _encode_bucket(root: Path, files: list[str], size, vae, space: dict, device, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    means, stds = [], []
    for start in range(0, len(files), batch):
        pixels = torch.stack([_pixels(root / f, size, space) for f in files[start : start + batch]])  # (n, C, H, W) in [-1, 1]
        if vae is None:
            means.append(pixels)
            stds.append(torch.zeros_like(pixels))
            continue
        posterior = vae.encode(pixels.to(device, vae.dtype)).latent_dist
        means.append(posterior.mean.float().cpu().half())
        stds.append(posterior.std.float().cpu().half())
    return torch.cat(means), torch.cat(stds)


def _pixels(file: Path, size, space: dict) -> torch.Tensor:
    try:
        with Image.open(file) as image:
            mode = "L" if space["kind"] == PIXELS and space["channels"] == 1 else "RGB"
            image = fit_to_bucket(image.convert(mode), size)
    except UNREADABLE as err:
        raise ConfigError(f"image '{file}' is unreadable ({type(err).__name__}); replace or delete it.") from None
    array = np.asarray(image, dtype=np.float32).reshape(size[1], size[0], -1)  # (H, W) or (H, W, 3) -> (H, W, C)
    return torch.from_numpy(array / 127.5 - 1).permute(2, 0, 1)  # (H, W, C) -> (C, H, W)


def save_atomic(path: Path, tensors: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_manifest(cfg_data) -> tuple[Path, dict]:
    folder = cache_folder(cfg_data)
    manifest = read_json(folder / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"data.path='{cfg_data.path}' has no caption cache in '{folder}' yet; the training command writes it "
                          "(python -m train ... data=captions data.path=...).")
    return folder, manifest


def text_table(folder: Path, family: str):
    """The prompt table of the cached captions (row K: the empty caption)."""
    return read_table(folder / TEXT, family)
