"""Image grids of class-conditional samples (one row per class), for training previews and train.sample."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torchvision.utils import make_grid, save_image

from train.files import write_atomic


def grid_labels(num_classes: int, per_class: int) -> torch.Tensor:
    """Labels laid out one class per row: (num_classes * per_class,)."""
    return torch.arange(max(num_classes, 1)).repeat_interleave(per_class)


def save_grid(images: torch.Tensor, path: Path, per_row: int) -> None:
    grid = make_grid(images, nrow=per_row, padding=1, pad_value=1.0)
    # Tiny images are upscaled (nearest) to at least 64 px so a person can see them without zooming.
    scale = max(1, 64 // images.shape[-1])
    grid = torch.nn.functional.interpolate(grid[None], scale_factor=scale, mode="nearest")[0]
    png = io.BytesIO()
    save_image(grid, png, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, png.getvalue())  # a full disk leaves no cut PNG
