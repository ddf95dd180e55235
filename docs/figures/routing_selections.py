"""Draws docs/figures/routing_selections.png: which tokens each routing policy processes, on a real Fashion-MNIST image.

    python docs/figures/routing_selections.py            # needs dataset-fashion-mnist (apt); falls back to the 8x8 digits

Panels: the image on its 16 x 16 token grid (patch 2), then the processed tokens of random and rows selection (TREAD,
ratio 0.5), structured selection at 0.5 (TREAD) and at 0.75 (SPRINT), and SPRINT's processed tokens laid out in
the order the route's blocks see them: the (8, 8) grid of groups, a jittered half-resolution copy of the image.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from routing import ConfigError, build_policy  # noqa: E402
from train.data import build_dataset  # noqa: E402

PATCH = 2


def image() -> tuple[torch.Tensor, str]:
    """One 32 x 32 image in [-1, 1]: the first Fashion-MNIST test image, or a digit when the data is not installed."""
    try:
        ds = build_dataset(OmegaConf.create({"name": "fashion_mnist", "path": "/usr/share/datasets/fashion-mnist",
                                             "split": "test", "resolution": 32}), 0.5)
        return ds.get(torch.tensor([0]))[0][0, 0], "Fashion-MNIST test image 0"
    except ConfigError:  # the data is not installed: draw the fallback
        ds = build_dataset(OmegaConf.create({"name": "digits", "resolution": 32}), 0.5)
        return ds.get(torch.tensor([0]))[0][0, 0], "scikit-learn digit 0"


def processed_mask(policy: str, ratio: float, grid: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, object]:
    x = torch.zeros(1, grid[0] * grid[1], 1)
    sel = build_policy(policy).select(x, grid, ratio, torch.Generator().manual_seed(seed))
    mask = torch.zeros(grid[0] * grid[1], dtype=torch.bool)
    mask[sel.indices[0]] = True
    return mask.view(grid), sel


def shade(img: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The image with bypassing tokens dimmed: mask (h, w) -> (H, W)."""
    full = mask.repeat_interleave(PATCH, 0).repeat_interleave(PATCH, 1)
    return torch.where(full, img, -1 + 0.25 * (img + 1))


def main(out: Path = Path(__file__).with_name("routing_selections.png")) -> None:
    img, what = image()
    grid = (img.shape[0] // PATCH, img.shape[1] // PATCH)
    panels = [("image, 16 x 16 tokens", img)]
    for title, policy, ratio in (("random 0.5 (TREAD, attention)", "random", 0.5), ("rows 0.5 (TREAD, scan order)", "rows", 0.5),
                                 ("structured 0.5 (2 of each 2x2)", "structured", 0.5),
                                 ("structured 0.75 (SPRINT, 1 of each 2x2)", "structured", 0.75)):
        mask, sel = processed_mask(policy, ratio, grid)
        panels.append((title, shade(img, mask)))
    # SPRINT's subset in processing order: token k of the (8, 8) subset grid is the kept patch of group k.
    patches = img.reshape(grid[0], PATCH, grid[1], PATCH).permute(0, 2, 1, 3).reshape(-1, PATCH, PATCH)  # (N, p, p)
    kept = patches[sel.indices[0]]  # (64, p, p), group by group
    h, w = sel.grid
    subset = kept.reshape(h, w, PATCH, PATCH).permute(0, 2, 1, 3).reshape(h * PATCH, w * PATCH)  # (h, w, p, p) -> (h p, w p)
    panels.append((f"SPRINT's subset as its blocks see it: a {h} x {w} grid", subset))
    fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3.4))
    for ax, (title, picture) in zip(axes, panels):
        ax.imshow(picture.numpy(), cmap="gray", vmin=-1, vmax=1)
        ax.set_title(title, fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"Processed tokens per policy on {what} (bypassing tokens dimmed; seed 0)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
