"""The cache of a captioned video folder: captions encoded by the pipeline's own text encoder (Wan: umT5), clips by
its video VAE (AutoencoderKLWan), from local folders only; `prepare_videos` writes it, `VideosDataset` reads it.

Layout of the cache folder (data.cache, default `<data.path>/.tread_cache`):
- `manifest.json`: the clips (relative path, caption row), the distinct captions, the latent space (the VAE's
  per-channel latents_mean and latents_std, its factors), and the key of each file below;
- `text.safetensors`: a prompt table (train/data/prompts.py): one row per distinct caption, the empty caption last;
- `videos.safetensors`: the VAE posterior (`mean`, `std`, unnormalised) of every clip's sample, (n, C, T', h, w)
  with T' = 1 + (frames - 1) / 4, in manifest order (frames in [-1, 1] as `mean`, `std` 0, with data.vae=pixels).

Each file is rewritten only when its key changes: the text when the captions or the encoder change, the latents when
the VAE, the sample settings (frames, stride, size) or any clip (path, size, time) change. Files are written atomically.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from routing.errors import ConfigError
from train.data.caption_cache import PIXELS, cache_folder, clean, identity, pipeline_folder, read_json, save_atomic, staged, vae_folder
from train.data.prompts import encode_table, read_table, write_table
from train.data.masks import BatchMasks, clip_coverage
from train.data.videos import Clip, clip_array, has_mask, sample_masks
from train.files import read_config, read_tensors, write_atomic

FORMAT = "tread-zoo-videos/1"
MANIFEST, TEXT, LATENTS = "manifest.json", "text.safetensors", "videos.safetensors"


def _key(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def prepare_videos(cfg, clips: list[Clip], device="cpu", log=print, stage: Path | None = None) -> Path:
    """(Re)write whatever part of the cache of data.path is out of date; returns the folder to read the cache from.
    Every refusal comes before the first write; `stage` as in caption_cache.prepare_captions (nothing written to the
    cache until `publish`)."""
    d = cfg.data
    root, cache = Path(str(d.path)).expanduser(), cache_folder(d)
    captions = sorted({clip.caption for clip in clips})
    pipeline, vae_dir = pipeline_folder(cfg), vae_folder(cfg)
    if vae_dir is None:
        space = {"kind": PIXELS, "channels": 3, "temporal": 1, "spatial": 1, "mean": [0.0] * 3, "std": [1.0] * 3}
    else:
        config = read_config(vae_dir / "config.json")
        from train.data.videos import vae_factors

        temporal, spatial, channels = vae_factors(cfg)
        space = {"kind": "vae", "identity": identity([vae_dir]), "channels": channels, "temporal": temporal, "spatial": spatial,
                 "mean": list(config.get("latents_mean") or [0.0] * channels), "std": list(config.get("latents_std") or [1.0] * channels)}
    out = stage or cache  # where new files go
    old = read_json(cache / MANIFEST)
    if stage is None:
        out.mkdir(parents=True, exist_ok=True)
        clean(cache)

    encoders = [pipeline / "model_index.json"] + sorted(p for p in pipeline.iterdir() if p.is_dir() and p.name.startswith(("text_encoder", "tokenizer")))
    text_key = _key({"encoders": identity(encoders), "captions": captions, "max_sequence_length": d.max_sequence_length,
                     "dtype": cfg.finetune.dtype})
    if old.get("text_key") != text_key or not (cache / TEXT).is_file():
        log(f"data=videos: encoding {len(captions)} distinct captions with the text encoder of {pipeline}")
        write_table(encode_table("wan", pipeline, captions, device=str(device), dtype=cfg.finetune.dtype,
                                 max_sequence_length=d.max_sequence_length), out / TEXT)

    sample = {"frames": d.frames, "stride": d.stride, "width": d.width, "height": d.height}
    latent_key = _key({"space": space, "sample": sample, "clips": [(c.file, c.stamp) for c in clips]})
    if old.get("latent_key") != latent_key or not (cache / LATENTS).is_file():
        log(f"data=videos: encoding {len(clips)} clips of {d.frames} frames at {d.width}x{d.height}"
            f"{' with the VAE in ' + str(vae_dir) if vae_dir is not None else ' (pixels)'}")
        mean, std = _encode(root, clips, sample, vae_dir, device)
        save_atomic(out / LATENTS, {"mean": mean, "std": std})

    manifest = {"format": FORMAT, "family": "wan", "files": [c.file for c in clips], "captions": captions,
                "labels": [captions.index(c.caption) for c in clips], "space": space, "sample": sample,
                "vae": str(vae_dir.resolve()) if vae_dir is not None else None, "text_key": text_key, "latent_key": latent_key,
                "source": str(root.resolve())}
    if json.loads(json.dumps(manifest)) != old:  # written only when it changes, as the files it lists are
        write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return out if stage is None else staged(stage, cache, [MANIFEST, TEXT, LATENTS])


@torch.no_grad()
def _encode(root: Path, clips: list[Clip], sample: dict, vae_dir: Path | None, device, batch: int = 4):
    vae = None
    if vae_dir is not None:
        from diffusers import AutoencoderKLWan

        vae = AutoencoderKLWan.from_pretrained(vae_dir, local_files_only=True).to(device).eval().requires_grad_(False)
    means, stds = [], []
    for start in range(0, len(clips), batch):
        arrays = [clip_array(root / c.file, sample["frames"], sample["stride"], sample["width"], sample["height"])
                  for c in clips[start : start + batch]]
        pixels = torch.from_numpy(np.stack(arrays))  # (n, 3, T, H, W) in [-1, 1]
        if vae is None:
            means.append(pixels)
            stds.append(torch.zeros_like(pixels))
            continue
        posterior = vae.encode(pixels.to(device, vae.dtype)).latent_dist  # (n, C, 1 + (T - 1) / 4, H / 8, W / 8)
        means.append(posterior.mean.float().cpu())
        stds.append(posterior.std.float().cpu())
    return torch.cat(means), torch.cat(stds)


def read_manifest(cfg_data) -> tuple[Path, dict]:
    folder = cache_folder(cfg_data)
    manifest = read_json(folder / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"data.path='{cfg_data.path}' has no video cache in '{folder}' yet; the training command writes it "
                          "(python -m train +experiment=finetune_wan data.path=...).")
    return folder, manifest


class VideosDataset:
    """Training samples from a video cache: latents (n, C, T', h, w) in Wan's model space, (z - latents_mean) /
    latents_std as WanPipeline denoises them, and caption rows as labels (row K: the empty caption)."""

    PREVIEW_CAPTIONS = 4

    def __init__(self, cfg_data):
        self.folder, manifest = read_manifest(cfg_data)
        self.manifest, self.space = manifest, manifest["space"]
        self.family = manifest["family"]
        self.captions: list[str] = manifest["captions"]
        self.num_classes = len(self.captions)
        self.preview_classes = min(self.num_classes, self.PREVIEW_CAPTIONS)
        self.labels = torch.tensor(manifest["labels"])
        if not (self.folder / LATENTS).is_file():
            raise ConfigError(f"the video cache '{self.folder}' lacks {LATENTS}; run the training command again to rewrite it.")
        tensors = read_tensors(self.folder / LATENTS, "delete it and run the training command again, which rewrites the cache")
        self.mean, self.std = tensors["mean"], tensors["std"]
        self.shape = tuple(self.mean.shape[1:])  # (C, T', h, w)
        c = self.shape[0]
        self._m = torch.tensor(self.space["mean"], dtype=torch.float32).view(1, c, 1, 1, 1)  # (C,) -> (1, C, 1, 1, 1)
        self._s = torch.tensor(self.space["std"], dtype=torch.float32).view(1, c, 1, 1, 1)
        self.name = f"videos-{len(self.labels)}"
        self._vae = None
        # Force-keep masks (masks.py), read per batch from beside the clips and frames.
        self.root = Path(str(cfg_data.path)).expanduser()
        self.mask_loss_weight = cfg_data.get("mask_loss_weight")
        sample = manifest["sample"]
        self._has_mask = [has_mask(self.root / f, sample["frames"], sample["stride"]) for f in manifest["files"]]

    def masks(self, indices: torch.Tensor) -> BatchMasks | None:
        """The batch's force-keep masks at latent resolution (B, T', h, w), fitted as its frames were; None when no clip
        of the folder has a mask."""
        if not any(self._has_mask):
            return None
        sample, space, rows = self.manifest["sample"], self.space, indices.cpu().tolist()
        size, (_, t, h, w) = (sample["width"], sample["height"]), self.shape
        coverage = []
        for i in rows:
            frames = sample_masks(self.root / self.manifest["files"][i], sample["frames"], sample["stride"])
            coverage.append(np.zeros((t, h, w), np.float32) if frames is None
                            else clip_coverage(frames, size, space["temporal"], space["spatial"]))
        return BatchMasks(torch.from_numpy(np.stack(coverage)), torch.tensor([self._has_mask[i] for i in rows]))

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_vae"] = None
        return state

    def prompt_table(self):
        return read_table(self.folder / TEXT, self.family)

    def read_from(self, folder: Path) -> None:
        """Read the cache from `folder` from now on (its latents are in memory; the prompt table is read from there)."""
        self.folder = folder

    def get(self, indices: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        indices = indices.cpu()
        mean, std = self.mean[indices].float(), self.std[indices].float()
        # Sample the VAE posterior z = mean + std * eps (pixels: std is 0), then Wan's normalisation.
        eps = torch.randn(mean.shape, generator=generator) if generator is not None else torch.randn_like(mean)
        return (mean + std * eps - self._m) / self._s, self.labels[indices]

    @torch.no_grad()
    def to_images(self, x: torch.Tensor) -> torch.Tensor:
        """Model-space samples (n, C, T', h, w) -> RGB videos (n, 3, T, H, W) in [0, 1], decoded by the VAE unless pixels."""
        z = x.float().cpu() * self._s + self._m
        if self.space["kind"] == PIXELS:
            return ((z + 1) / 2).clamp(0, 1)
        if self._vae is None:
            from diffusers import AutoencoderKLWan

            self._vae = AutoencoderKLWan.from_pretrained(self.manifest["vae"], local_files_only=True).eval()
        return ((self._vae.decode(z).sample.float() + 1) / 2).clamp(0, 1)
