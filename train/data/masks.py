"""Force-keep masks from the data: an optional `name.mask.png` beside a sample, as SimpleTuner users give them.

Where a mask lives: beside an image `name.png` (data=captions), beside a clip `name.mp4` (one mask for every frame,
data=videos) or beside a frame `clip/0001.png` of a frame folder (`clip/0001.mask.png`, that frame's mask). It is a
greyscale (L) or 1-bit PNG of exactly its image's (frame's) size; white (>= 128) marks the region. Masks are read
when a batch is drawn (never cached: editing one takes effect on the next run, and no cache key has to change).

What a mask does:
- routing: a token the mask touches (any of its pixels, after the sample's crop and resize) is force-kept by every
  policy: routing.policy's `select(..., force_keep=...)` processes it on every route (`force_keep`);
- the loss: with `data.mask_loss_weight=[inside, outside]` each latent pixel's loss is weighted by
  outside + (inside - outside) x the fraction of it the mask covers (`loss_weight`); [1, 0] is SimpleTuner's masked
  loss. A sample without a mask weighs 1 everywhere, so mixing masked and unmasked samples is allowed.

The geometry is the image's own: the crop and resize of buckets.fit_to_bucket (captions) or buckets.fit_frame (clips),
with area (box) resampling so that coverage is a fraction in [0, 1] and an unmasked pixel stays exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from routing.errors import ConfigError
from train.data.buckets import fit_frame, fit_to_bucket

SUFFIX = ".mask.png"
MODES = ("1", "L")  # 1-bit or 8-bit grey: a single channel with no palette to misread
# What PIL raises for truncated, corrupt or hostile files (as captions.UNREADABLE; not imported: captions imports us).
UNREADABLE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def is_mask_file(path: Path) -> bool:
    # Exactly as mask_file spells it: a NAME.MASK.PNG is taken for an image, whose missing caption is then refused.
    return path.name.endswith(SUFFIX)


def _stem(item: Path) -> str:
    return item.name if item.is_dir() else item.stem


def mask_file(item: Path) -> Path:
    """Where the mask of an image, clip file or frame lives: `name.mask.png` beside `name.<ext>`."""
    return item.with_name(_stem(item) + SUFFIX)


def check_weights(weights) -> None:
    """Refuse data.mask_loss_weight=[0, 0]: a masked sample would then train nothing at all (the range and the two
    values are the schema's)."""
    if weights is not None and not any(float(w) > 0 for w in weights):
        raise ConfigError(f"data.mask_loss_weight={list(weights)} weighs every pixel of a masked sample 0, so those samples "
                          "would train nothing; give inside > 0 (e.g. data.mask_loss_weight=[1.0,0.0], SimpleTuner's masked loss).")


def check_sample_weights(sample: Path, masks: list[Path], weights) -> None:
    """Refuse masks that weigh every pixel of `sample` 0 under data.mask_loss_weight=[inside, outside]: an all-white mask
    with inside 0, or an all-black one (an empty mask) with outside 0, on each of its frames (`masks`: one per frame, or
    one for all; a frame without a mask weighs 1). Read only when a weight is 0."""
    if weights is None or not masks or all(float(w) > 0 for w in weights):
        return
    inside, outside = (float(w) for w in weights)
    said = []
    for path in masks:
        with Image.open(path) as mask:
            low, high = mask.convert("L").getextrema()
        if low >= 128 and inside == 0:
            said.append((path, "all white", "inside"))
        elif high < 128 and outside == 0:
            said.append((path, "all black", "outside"))
        else:
            return
    path, colour, where = said[0]
    raise ConfigError(f"mask '{path}' is {colour}{' (so are the masks of its other frames)' if len(said) > 1 else ''}, and "
                      f"data.mask_loss_weight={[float(w) for w in weights]} weighs {where} the region 0, so '{sample}' would train "
                      f"nothing; mark the region in the mask, give {where} a weight > 0, or delete the mask.")


def check_mask(path: Path, size: tuple[int, int], of: Path) -> None:
    """Refuse, in one sentence, a mask that is unreadable, not single-channel grey, or not the size of `of` (its image)."""
    try:
        with Image.open(path) as mask:
            mode, mask_size = mask.mode, mask.size
    except UNREADABLE as err:
        raise ConfigError(f"mask '{path}' is unreadable ({type(err).__name__}); save it again as a greyscale PNG or delete it.") from None
    if mode not in MODES:
        raise ConfigError(f"mask '{path}' has mode {mode}; save it as a greyscale (L) or 1-bit PNG, white where tokens are kept "
                          "(e.g. PIL's image.convert('L')).")
    if mask_size != tuple(size):
        raise ConfigError(f"mask '{path}' is {mask_size[0]}x{mask_size[1]} but its image '{of}' is {size[0]}x{size[1]}; save the "
                          "mask at its image's size.")


def check_orphans(root: Path, items) -> None:
    """Refuse a mask file beside no image (a renamed image, a typo): it would be ignored in silence."""
    known = {(p.parent, _stem(p)) for p in items}
    for path in sorted(root.rglob(f"*{SUFFIX}")):
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        stem = path.name[: -len(SUFFIX)]
        if (path.parent, stem) not in known:
            raise ConfigError(f"mask '{path}' has no image beside it (expected '{stem}.<ext>' in '{path.parent}'); rename it after "
                              "its image, or delete it.")


def read_mask(path: Path) -> Image.Image:
    """A mask as an L image with values 0 and 255 (threshold 128), for area resampling."""
    with Image.open(path) as mask:
        return mask.convert("L").point(lambda v: 255 if v >= 128 else 0)


def fit_coverage(mask: Image.Image, size: tuple[int, int], crop: str = "bucket") -> np.ndarray:
    """(height, width) float32 in [0, 1]: the fraction of each pixel of the fitted sample that the mask covers.

    The image's own geometry with area resampling: `bucket` as buckets.fit_to_bucket (box-halving, cover, centre
    crop), `frame` as buckets.fit_frame (centre crop to the aspect, then resize)."""
    fit = fit_frame if crop == "frame" else fit_to_bucket
    mask = fit(mask, size, resample=Image.Resampling.BOX)
    return np.asarray(mask, dtype=np.float32) / 255.0


def pool(coverage: np.ndarray, factor: int) -> np.ndarray:
    """Pixel coverage (H, W) -> latent coverage (H / factor, W / factor): the mean over each latent pixel's block."""
    h, w = coverage.shape[0] // factor, coverage.shape[1] // factor
    return coverage[: h * factor, : w * factor].reshape(h, factor, w, factor).mean((1, 3))  # (H, W) -> (h, f, w, f) -> (h, w)


def clip_coverage(frames: list[Image.Image | None], size: tuple[int, int], temporal: int, spatial: int) -> np.ndarray:
    """(T', h, w) latent coverage of a clip sample from its sampled frames' masks (None: that frame has none).

    A latent frame holds the frames the VAE folds into it (Wan: the first alone, then `temporal` each), so it is
    covered wherever any of them is masked (the largest coverage)."""
    width, height = size
    per_frame = [pool(fit_coverage(m, size, crop="frame"), spatial) if m is not None
                 else np.zeros((height // spatial, width // spatial), np.float32) for m in frames]
    groups = [per_frame[:1]] + [per_frame[1 + temporal * t : 1 + temporal * (t + 1)] for t in range((len(frames) - 1) // temporal)]
    return np.stack([np.max(np.stack(g), axis=0) for g in groups])  # T' x (h, w) -> (T', h, w)


@dataclass
class BatchMasks:
    """A batch's masks at latent resolution."""

    coverage: torch.Tensor  # (B, h, w) or (B, T', h, w) float32 in [0, 1]: the fraction of each latent pixel masked
    present: torch.Tensor  # (B,) bool: the sample has a mask (one without weighs 1 everywhere)


def force_keep(masks: BatchMasks, patch: int | tuple[int, ...]) -> torch.Tensor:
    """(B, N) bool over the token grid in raster order: True where the mask touches any pixel of the token.

    `patch`: the model's patch over the latent, p (images) or (p_t, p_h, p_w) (video); N = prod(latent / patch)."""
    cov = masks.coverage
    dims = cov.ndim - 1
    kernel = (patch,) * dims if isinstance(patch, int) else tuple(patch)
    if len(kernel) != dims or any(side % k for side, k in zip(cov.shape[1:], kernel)):
        raise ConfigError(f"a mask's latent grid {tuple(cov.shape[1:])} is not a whole number of patches {kernel}; this is a bug "
                          "of the caller (pass the model's patch).")
    pooled = (F.max_pool2d if dims == 2 else F.max_pool3d)(cov.unsqueeze(1), kernel)  # (B, 1, *grid): the largest coverage per token
    return (pooled > 0).flatten(1)  # (B, 1, *grid) -> (B, N)


def loss_weight(masks: BatchMasks, weights) -> torch.Tensor:
    """(B, 1, *latent) float32: `outside` + (`inside` - `outside`) x coverage, and 1 for a sample without a mask; it
    multiplies the per-element loss (B, C, *latent) by broadcasting over the channels."""
    inside, outside = (float(w) for w in weights)
    weight = outside + (inside - outside) * masks.coverage
    present = masks.present.view(-1, *([1] * (masks.coverage.ndim - 1)))  # (B,) -> (B, 1, ...)
    return torch.where(present, weight, torch.ones_like(weight)).unsqueeze(1)  # (B, *latent) -> (B, 1, *latent)


def mask_inputs(dataset, indices: torch.Tensor, patch, weights=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What the trainer passes on for a batch: (force_keep (B, N) bool for the router, loss weight (B, 1, *latent)), each
    None when the dataset has no masks (or `weights` is None for the loss). The one call the trainer makes per batch."""
    masks = dataset.masks(indices) if hasattr(dataset, "masks") else None
    if masks is None:
        return None, None
    return force_keep(masks, patch), (loss_weight(masks, weights) if weights is not None else None)
