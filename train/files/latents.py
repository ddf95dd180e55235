"""A latents folder's meta.json and stats.json, as `python -m train.cache_latents` writes them (docs/latents.md).

Both are read once, when the dataset opens; what they return (typed, in range, channels matching) needs no
check at the first batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from train.files.typed import MISSING, damaged, finite, read_json, typed

REDO = ("re-create the folder with `python -m train.cache_latents` (the same --out resumes it and rewrites missing "
        "shards), or point data.path at one it wrote")


@dataclass
class Shard:
    file: str = MISSING  # a file name inside the folder
    count: int = MISSING  # latents it holds


@dataclass
class LatentsMeta:
    """meta.json (fields written by older versions are optional; unknown fields are ignored)."""

    complete: bool = False
    num_classes: int = MISSING
    class_names: List[str] = MISSING
    latent_shape: List[int] = MISSING  # (C, h, w)
    scaling_factor: float = MISSING
    shift_factor: float = 0.0  # caches written before it was recorded: SD-VAE, 0
    vae: Optional[str] = None
    # What train.cache_latents stored beside each latent for align=repa: {"images": side} and/or {"features":
    # {encoder, weights, input_size, grid, dim}}; None when nothing was.
    align: Optional[Dict[str, Any]] = None
    shards: List[Dict[str, Any]] = MISSING
    entries: List[Shard] = field(default_factory=list)  # `shards`, typed


@dataclass
class AlignFeatures:
    """meta.json's align.features: the frozen encoder whose patch features each shard holds."""

    encoder: str = MISSING
    weights: Optional[str] = None
    input_size: int = MISSING
    grid: List[int] = MISSING  # the encoder's patch grid (gh, gw)
    dim: int = MISSING  # feature width


@dataclass
class LatentStats:
    """stats.json: per-channel mean and std of the scaled posterior samples."""

    mean: List[float] = MISSING
    std: List[float] = MISSING


def read_meta(folder: Path) -> LatentsMeta:
    path = folder / "meta.json"
    meta = typed(LatentsMeta, read_json(path, REDO), path, REDO)
    if meta.num_classes < 1:
        raise damaged(path, f"field 'num_classes' = {meta.num_classes} is not a positive count", REDO)
    if len(meta.class_names) != meta.num_classes:
        raise damaged(path, f"lists {len(meta.class_names)} class_names for num_classes = {meta.num_classes}", REDO)
    if len(meta.latent_shape) != 3 or min(meta.latent_shape) < 1:
        raise damaged(path, f"field 'latent_shape' = {meta.latent_shape} is not three positive sizes (C, h, w)", REDO)
    if not (finite([meta.scaling_factor, meta.shift_factor]) and meta.scaling_factor > 0):
        raise damaged(path, f"field 'scaling_factor' = {meta.scaling_factor} (shift_factor {meta.shift_factor}) is not a "
                            "positive finite number", REDO)
    if not meta.shards:
        raise damaged(path, "lists no shards", REDO)
    meta.entries = [typed(Shard, entry, path, REDO, where=f"shards[{i}].") for i, entry in enumerate(meta.shards)]
    _check_align(meta.align, path)
    for i, shard in enumerate(meta.entries):
        if shard.count < 0 or Path(shard.file).name != shard.file or shard.file in ("", ".", ".."):
            raise damaged(path, f"shard {i} ({shard.file!r}, count {shard.count}) is not a file name in the folder with "
                                "a count >= 0", REDO)
    return meta


def _check_align(align: Optional[Dict[str, Any]], path: Path) -> None:
    """align: {"images": side} and/or {"features": AlignFeatures}, each in range, or nothing."""
    if not align:
        return
    unknown = sorted(set(align) - {"images", "features"})
    side = align.get("images")
    if unknown or (side is not None and (not isinstance(side, int) or isinstance(side, bool) or side < 1)):
        raise damaged(path, f"field 'align' = {align!r} is not {{\"images\": a side in pixels, \"features\": the encoder's}}", REDO)
    if "features" in align:
        how = typed(AlignFeatures, align["features"], path, REDO, where="align.features.")
        if len(how.grid) != 2 or min(how.grid) < 1 or how.dim < 1 or how.input_size < 1:
            raise damaged(path, f"field 'align.features' has grid {how.grid}, dim {how.dim} and input_size {how.input_size}, not two "
                                "positive sides and positive sizes", REDO)


def read_stats(folder: Path, channels: int) -> LatentStats:
    """stats.json, with one finite mean and one positive finite std per latent channel."""
    path = folder / "stats.json"
    stats = typed(LatentStats, read_json(path, REDO), path, REDO)
    for name in ("mean", "std"):
        values = getattr(stats, name)
        if len(values) != channels:
            raise damaged(path, f"field '{name}' has {len(values)} values for the {channels} latent channels of "
                                "meta.json", REDO)
    if not (finite(stats.mean) and finite(stats.std) and min(stats.std) > 0):
        raise damaged(path, f"has a non-finite or zero channel std/mean (std {stats.std}), so the latents would be "
                            "NaN/inf or constant", REDO)
    return stats
