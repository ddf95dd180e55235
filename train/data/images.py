"""Image files on disk: the one listing function, labelled folders, and the ADM centre crop.

Used by latent caching (`train.cache_latents`) and by FID on image folders alike.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from routing.errors import ConfigError
from train.files import damaged, read_text

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def image_files(folder: Path) -> list[Path]:
    """Image files under `folder`, recursively, in sorted order."""
    return sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def list_images(root: Path, labels_file: Path | None = None) -> tuple[list[str], list[int], list[str]]:
    """Relative file paths, label ids and class names for an image folder."""
    if labels_file is not None:
        return _list_from_labels_file(root, labels_file)
    class_dirs = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not class_dirs:
        raise ConfigError(
            f"--images {str(root)!r} has no class subfolders: use one subfolder per class, "
            f"or pass --labels-file with `filename,label` rows for a flat folder."
        )
    files, labels = [], []
    for label, name in enumerate(class_dirs):
        found = image_files(root / name)
        files += [file.relative_to(root).as_posix() for file in found]
        labels += [label] * len(found)
    return files, labels, class_dirs


def _list_from_labels_file(root: Path, labels_file: Path) -> tuple[list[str], list[int], list[str]]:
    fix = "pass a CSV file of `filename,label` rows"
    try:
        rows = [row for row in csv.reader(io.StringIO(read_text(labels_file, fix), newline="")) if row]
    except csv.Error as err:
        raise damaged(labels_file, f"is not a CSV file ({err})", fix) from None
    if rows and rows[0][0].strip().lower() == "filename":
        rows = rows[1:]
    if not rows or any(len(row) < 2 for row in rows):
        raise ConfigError(f"--labels-file {str(labels_file)!r} must hold `filename,label` rows.")
    files = [row[0].strip() for row in rows]
    raw = [row[1].strip() for row in rows]
    # Integer labels are used as ids; any other labels are class names, sorted -> ids.
    if all(value.lstrip("-").isdigit() for value in raw):
        labels = [int(value) for value in raw]
        if min(labels) < 0:
            raise ConfigError(f"--labels-file {str(labels_file)!r} has a negative label.")
        class_names = [str(i) for i in range(max(labels) + 1)]
    else:
        class_names = sorted(set(raw))
        labels = [class_names.index(value) for value in raw]
    order = sorted(range(len(files)), key=files.__getitem__)
    return [files[i] for i in order], [labels[i] for i in order], class_names


def center_crop_resize(image: Image.Image, size: int) -> Image.Image:
    """ADM-style centre crop: box-halve while twice too big, bicubic to the short side, crop the centre."""
    while min(image.size) >= 2 * size:
        image = image.resize(tuple(side // 2 for side in image.size), resample=Image.Resampling.BOX)
    scale = size / min(image.size)
    image = image.resize(tuple(round(side * scale) for side in image.size), resample=Image.Resampling.BICUBIC)
    left, top = (image.width - size) // 2, (image.height - size) // 2
    return image.crop((left, top, left + size, top + size))




def load_image(file: Path, size: int | None = None) -> torch.Tensor:
    """An image file as (3, H, W) uint8 RGB, centre-cropped and resized to size x size when given."""
    with Image.open(file) as image:
        image = image.convert("RGB")
        if size is not None:
            image = center_crop_resize(image, size)
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # (H, W, 3) -> (3, H, W)
