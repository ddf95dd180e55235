"""`data:` one schema per dataset (the keys differ), picked by `data.name` and checked by `check_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from train.schema.keys import key


@dataclass
class DigitsData:
    """scikit-learn's handwritten digits (embedded), upsampled."""

    name: str = key("digits", "dataset", example="digits")
    resolution: int = key(16, "image side after upsampling", ge=8, le=1024, example=16)


@dataclass
class ShapesData:
    """Procedural class-conditional RGB shapes, deterministic from the seed."""

    name: str = key("shapes", "dataset", example="shapes")
    resolution: int = key(32, "image side", ge=8, le=1024, example=32)
    num_images: int = key(4096, "images generated", ge=1, example=4096)
    seed: int = key(0, "generation seed", ge=0, example=0)


@dataclass
class FashionMNISTData:
    """Fashion-MNIST idx files, padded."""

    name: str = key("fashion_mnist", "dataset", example="fashion_mnist")
    path: str = key("/usr/share/datasets/fashion-mnist", "folder with {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]", example="/data/fashion-mnist")
    split: str = key("train", "split", choices=("train", "test"), example="train")
    resolution: int = key(32, "padded image side", ge=28, le=1024, example=32)


@dataclass
class LatentsData:
    """Cached VAE latents written by `python -m train.cache_latents`."""

    name: str = key("latents", "dataset", example="latents")
    path: Optional[str] = key(None, "the cache_latents --out folder (required)", example="/data/latents/in256")
    normalize: str = key("standardize", "standardize: per-channel std sigma_data | scale: VAE factor only", choices=("standardize", "scale"), example="standardize")
    vae: Optional[str] = key(None, "VAE for decoding sample grids (null: the one in meta.json)", example="/weights/sd-vae-ft-ema")


DATA = {"digits": DigitsData, "shapes": ShapesData, "fashion_mnist": FashionMNISTData, "latents": LatentsData}
