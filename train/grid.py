"""Class-conditional sampling into an image grid (one row per class), for training previews and train.sample."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.utils import make_grid, save_image

from edm import SAMPLERS, CFGDenoiser, edm_sigmas


@torch.no_grad()
def generate(net, labels: torch.Tensor, *, shape, steps: int, guidance: float, seed: int, device, sampler: str = "heun",
             null_label: int | None = None, progress: bool = False) -> torch.Tensor:
    """Samples in model space (n, C, H, W) for `labels`; the same seed gives the same noise at every call."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(labels), *shape, generator=generator).to(device)
    sigmas = edm_sigmas(steps, device=device)
    # Guidance needs the null class; without one (or with w = 1) the plain conditional model is used.
    denoiser = CFGDenoiser(net, guidance, null_label) if null_label is not None else net
    x = SAMPLERS[sampler](denoiser, noise * sigmas[0], sigmas, extra_args={"class_labels": labels.to(device)}, disable=not progress)
    return x.float()


def grid_labels(num_classes: int, per_class: int) -> torch.Tensor:
    """Labels laid out one class per row: (num_classes * per_class,)."""
    return torch.arange(max(num_classes, 1)).repeat_interleave(per_class)


def save_grid(images: torch.Tensor, path: Path, per_row: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    grid = make_grid(images, nrow=per_row, padding=1, pad_value=1.0)
    # Tiny images are upscaled (nearest) to at least 64 px so a person can see them without zooming.
    scale = max(1, 64 // images.shape[-1])
    grid = torch.nn.functional.interpolate(grid[None], scale_factor=scale, mode="nearest")[0]
    save_image(grid, str(path))
