"""`CaptionsDataset`: training samples from a captioned folder's cache (caption_cache.py), batched by bucket.

Beyond the dataset protocol of train.data (num_classes, shape, get, to_images) it offers what bucketed data needs:
- `batch_indices(seed, step, size)`: the indices of a global batch, all from one bucket (buckets.BucketSchedule);
- `shape_of(indices)`: the latent shape (C, h, w) of that batch's bucket, for the trainer's noise;
- `prompt_table()`: the captions' prompt table, the conditioning the text families look rows up in;
- `preview_classes`: how many captions a preview grid shows (the first ones, one row each);
- `masks(indices)`: the batch's force-keep masks (masks.py), None when the folder has none.
Labels are caption rows; the null label K is the empty caption.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from routing.errors import ConfigError
from train.data.buckets import BucketSchedule
from train.data.caption_cache import PIXELS, read_manifest, text_table
from train.data.latents import _memmap_shard
from train.data.masks import BatchMasks, fit_coverage, mask_file, pool, read_mask
from train.files import tensor_shapes

PREVIEW_CAPTIONS = 4


REWRITE = "delete it and run the training command again, which rewrites the cache"


class CaptionsDataset:
    def __init__(self, cfg_data):
        self.folder, manifest = read_manifest(cfg_data)
        self.family, self.manifest = manifest["family"], manifest  # the family whose text encoders wrote the table
        self.captions: list[str] = manifest["captions"]
        self.num_classes = len(self.captions)
        self.preview_classes = min(self.num_classes, PREVIEW_CAPTIONS)
        self.labels = torch.tensor(manifest["labels"])
        self.bucket_of = manifest["bucket_of"]
        space = manifest["space"]
        self.space, factor, channels = space, space["factor"], space["channels"]
        self.bucket_shapes = [(channels, h // factor, w // factor) for w, h in manifest["buckets"]]  # (C, h, w) per bucket
        # A file's rows follow manifest order within its bucket: dataset index -> (bucket, row).
        self.row = np.zeros(len(self.bucket_of), dtype=np.int64)
        counts = [0] * len(self.bucket_shapes)
        for index, bucket in enumerate(self.bucket_of):
            self.row[index], counts[bucket] = counts[bucket], counts[bucket] + 1
        self.files = []
        for (w, h), count in zip(manifest["buckets"], counts):
            path = self.folder / f"latents-{w}x{h}.safetensors"
            if not path.is_file():
                raise ConfigError(f"the caption cache '{self.folder}' lacks {path.name}; run the training command again to rewrite it.")
            tensor_shapes(path, REWRITE)  # a file cut short is named here, not at the first batch that reads it
            self.files.append(path)
        # Previews and FID use the most populated bucket's shape.
        self.shape = self.bucket_shapes[max(range(len(counts)), key=counts.__getitem__)]
        self.schedule = BucketSchedule(self.bucket_of)
        self.name = f"captions-{len(self.bucket_of)}"
        self._maps: dict[int, dict] = {}
        self._vae = None
        # Force-keep masks (masks.py), read per batch from beside the images: dataset index -> mask file.
        root = Path(str(cfg_data.path)).expanduser()
        self.mask_files = {i: m for i, f in enumerate(manifest["files"]) if (m := mask_file(root / f)).is_file()}
        self.mask_loss_weight = cfg_data.get("mask_loss_weight")

    def __len__(self) -> int:
        return len(self.bucket_of)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"], state["_vae"] = {}, None
        return state

    def prompt_table(self):
        return text_table(self.folder, self.family)

    def read_from(self, folder: Path) -> None:
        """Read the cache from `folder` from now on (the trainer staged new cache files, then published them there)."""
        self.folder, self.files, self._maps = folder, [folder / path.name for path in self.files], {}

    def batch_indices(self, seed: int, step: int, size: int) -> torch.Tensor:
        return self.schedule.batch(seed, step, size)

    def shape_of(self, indices: torch.Tensor) -> tuple[int, int, int]:
        return self.bucket_shapes[self.bucket_of[int(indices[0])]]

    def _map(self, bucket: int) -> dict:
        if bucket not in self._maps:
            self._maps[bucket] = _memmap_shard(self.files[bucket])
        return self._maps[bucket]

    def get(self, indices: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (n, C, h, w) in model space, (z - shift_factor) * scaling_factor, and caption rows (n,)."""
        indices = indices.cpu()
        buckets = {self.bucket_of[int(i)] for i in indices}
        if len(buckets) != 1:
            raise ValueError(f"a batch mixes buckets {sorted(buckets)}; batches come from batch_indices")
        arrays = self._map(buckets.pop())
        rows = self.row[indices.numpy()]
        mean = torch.from_numpy(np.asarray(arrays["mean"][rows], dtype=np.float32))
        std = torch.from_numpy(np.asarray(arrays["std"][rows], dtype=np.float32))
        # Sample the VAE posterior, z = mean + std * eps (pixels: std is 0), then the VAE's own convention.
        eps = torch.randn(mean.shape, generator=generator) if generator is not None else torch.randn_like(mean)
        z = mean + std * eps
        return (z - self.space["shift_factor"]) * self.space["scaling_factor"], self.labels[indices]

    def masks(self, indices: torch.Tensor) -> BatchMasks | None:
        """The batch's force-keep masks at latent resolution (B, h, w), fitted as its images were; None when no image of
        the folder has a mask."""
        if not self.mask_files:
            return None
        width, height = self.manifest["buckets"][self.bucket_of[int(indices[0])]]
        factor, rows = self.space["factor"], indices.cpu().tolist()
        empty = np.zeros((height // factor, width // factor), dtype=np.float32)
        coverage = [pool(fit_coverage(read_mask(self.mask_files[i]), (width, height)), factor) if i in self.mask_files else empty
                    for i in rows]
        return BatchMasks(torch.from_numpy(np.stack(coverage)), torch.tensor([i in self.mask_files for i in rows]))

    @torch.no_grad()
    def to_images(self, x: torch.Tensor) -> torch.Tensor:
        """Model-space samples (n, C, h, w) -> RGB or grey images in [0, 1] (decoded by the VAE unless pixels)."""
        if self.space["kind"] == PIXELS:
            return ((x.float() + 1) / 2).clamp(0, 1)
        if self._vae is None:
            from diffusers import AutoencoderKL

            self._vae = AutoencoderKL.from_pretrained(self.manifest["vae"], local_files_only=True).eval()
        vae = self._vae.to(x.device)
        z = x.float() / self.space["scaling_factor"] + self.space["shift_factor"]
        return ((vae.decode(z).sample.float() + 1) / 2).clamp(0, 1)
