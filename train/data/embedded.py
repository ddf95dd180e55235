"""Datasets that need no download and no files: scikit-learn's handwritten digits and procedural shapes.

Both live in memory as tensors in model space ([-1, 1] pixels) and implement the dataset protocol of
train.data: num_classes, shape, __len__, get(indices, generator), to_images(x).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


class TensorDataset:
    """In-memory images (n, C, H, W) in [-1, 1] with labels (n,)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int, name: str):
        self.images, self.labels = images.contiguous(), labels.long()
        self.num_classes, self.name = num_classes, name
        self.shape = tuple(images.shape[1:])

    def __len__(self) -> int:
        return self.images.shape[0]

    def get(self, indices: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[indices], self.labels[indices]

    def to_images(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.float() + 1) / 2).clamp(0, 1)


def digits(resolution: int = 16) -> TensorDataset:
    """The 1,797 8x8 handwritten digits shipped with scikit-learn, upsampled to `resolution`."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(bunch.images).float()[:, None] / 16.0  # (n, 8, 8) -> (n, 1, 8, 8) in [0, 1]
    images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False, antialias=True)
    return TensorDataset(images.clamp(0, 1) * 2 - 1, torch.from_numpy(bunch.target), 10, "digits")


SHAPES = ("disk", "square", "ring", "cross", "triangle")
PALETTE = ((0.95, 0.35, 0.2), (0.2, 0.55, 0.95))


def shapes(resolution: int = 32, num_images: int = 4096, seed: int = 0) -> TensorDataset:
    """Deterministic class-conditional RGB shapes: class = shape (5) x colour (2) on a soft gradient background.

    Position, size and rotation vary per image, so the model must learn spatial structure, not a template.
    """
    rng = np.random.default_rng(seed)
    coords = (np.arange(resolution) + 0.5) / resolution * 2 - 1
    yy, xx = np.meshgrid(coords, coords, indexing="ij")  # (H, W) each, in [-1, 1]
    images = np.empty((num_images, 3, resolution, resolution), dtype=np.float32)
    labels = rng.integers(0, len(SHAPES) * len(PALETTE), size=num_images)
    for n, label in enumerate(labels):
        shape, colour = SHAPES[label % len(SHAPES)], np.array(PALETTE[label // len(SHAPES)])
        cy, cx = rng.uniform(-0.35, 0.35, size=2)
        r = rng.uniform(0.3, 0.55)
        angle = rng.uniform(0, math.pi)
        # Rotate the frame so squares, crosses and triangles appear at any orientation.
        u = (xx - cx) * math.cos(angle) + (yy - cy) * math.sin(angle)
        v = -(xx - cx) * math.sin(angle) + (yy - cy) * math.cos(angle)
        dist = _signed_distance(shape, u, v, r)
        alpha = 1 / (1 + np.exp(dist * resolution * 1.5))  # soft edge about one pixel wide
        background = 0.15 + 0.15 * (yy + 1)[None] * np.array([0.4, 0.5, 0.6])[:, None, None]
        images[n] = background * (1 - alpha) + colour[:, None, None] * alpha
    return TensorDataset(torch.from_numpy(images) * 2 - 1, torch.from_numpy(labels), len(SHAPES) * len(PALETTE), "shapes")


def _signed_distance(shape: str, u: np.ndarray, v: np.ndarray, r: float) -> np.ndarray:
    """Negative inside the shape, in the rotated frame (u, v)."""
    if shape == "disk":
        return np.hypot(u, v) - r
    if shape == "square":
        return np.maximum(abs(u), abs(v)) - 0.8 * r
    if shape == "ring":
        return abs(np.hypot(u, v) - 0.7 * r) - 0.25 * r
    if shape == "cross":
        bar = lambda a, b: np.maximum(abs(a) - r, abs(b) - 0.3 * r)  # noqa: E731
        return np.minimum(bar(u, v), bar(v, u))
    # Equilateral triangle: the largest of the three edge half-plane distances.
    edges = [u * math.cos(t) + v * math.sin(t) for t in (math.pi / 2, math.pi / 2 + 2 * math.pi / 3, math.pi / 2 + 4 * math.pi / 3)]
    return np.maximum.reduce(edges) - 0.5 * r
