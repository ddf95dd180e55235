"""Image grids of class-conditional samples (one row per class), for training previews and train.sample; video
samples become animated grids (GIF, or MP4 through imageio-ffmpeg), one grid per frame."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from torchvision.utils import make_grid, save_image

from train.files import write_atomic

VIDEO_SUFFIXES = (".gif", ".mp4")
FPS = 8  # frames per second of written videos (Wan samples 16 fps; tiny clips read better slower)


def grid_labels(num_classes: int, per_class: int) -> torch.Tensor:
    """Labels laid out one class per row: (num_classes * per_class,)."""
    return torch.arange(max(num_classes, 1)).repeat_interleave(per_class)


def _grid(images: torch.Tensor, per_row: int) -> torch.Tensor:
    grid = make_grid(images, nrow=per_row, padding=1, pad_value=1.0)
    # Tiny images are upscaled (nearest) to at least 64 px so a person can see them without zooming.
    scale = max(1, 64 // images.shape[-1])
    return torch.nn.functional.interpolate(grid[None], scale_factor=scale, mode="nearest")[0]


def save_grid(images: torch.Tensor, path: Path, per_row: int) -> Path:
    """Write images (n, C, H, W) in [0, 1] as one PNG grid, or videos (n, C, T, H, W) as an animated grid: a GIF, or
    an MP4 when `path` ends in .mp4 (any other suffix becomes .gif). Written atomically; returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if images.ndim == 4:
        png = io.BytesIO()
        save_image(_grid(images, per_row), png, format="png")
        write_atomic(path, png.getvalue())  # a full disk leaves no cut PNG
        return path
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        path = path.with_suffix(".gif")
    frames = [_grid(images[:, :, i], per_row) for i in range(images.shape[2])]  # (n, C, T, H, W) -> T grids (C, H', W')
    pixels = [(f.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).expand(-1, -1, 3).numpy() for f in frames]  # (H', W', 3)
    # write_atomic's temporary (`.<name>.<pid>.tmp`) has no video suffix, so each writer is told its format; the pid in
    # its name lets the next start remove one a kill left (train/rundir.py, remove_stale_temporaries).
    write_atomic(path, (lambda tmp: _write_mp4(pixels, tmp)) if path.suffix.lower() == ".mp4" else (lambda tmp: _write_gif(pixels, tmp)))
    return path


def _write_gif(frames: list[np.ndarray], path: Path) -> None:
    from PIL import Image

    first, *rest = [Image.fromarray(np.ascontiguousarray(p)) for p in frames]
    first.save(path, format="GIF", save_all=True, append_images=rest, duration=round(1000 / FPS), loop=0)


def _write_mp4(frames: list[np.ndarray], path: Path) -> None:
    import imageio_ffmpeg

    h, w = frames[0].shape[:2]
    pad = ((0, h % 2), (0, w % 2), (0, 0))  # H.264 in yuv420p needs even sides
    writer = imageio_ffmpeg.write_frames(str(path), (w + w % 2, h + h % 2), fps=FPS, macro_block_size=1, quality=8,
                                         output_params=["-f", "mp4"])  # the temporary's name has no suffix to go by
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(np.pad(frame, pad)))
    writer.close()
