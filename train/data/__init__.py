"""Data: the dataset registry, embedded datasets, Fashion-MNIST, latent datasets, captioned folders with aspect-ratio
buckets, image files, and latent caching.

Every dataset offers num_classes, shape (C, H, W), __len__,
get(indices, generator) -> (x in model space, labels) and to_images(x) -> [0, 1] images for grids."""

from __future__ import annotations

from omegaconf import DictConfig

from routing.errors import ConfigError


def build_dataset(cfg_data: DictConfig, sigma_data: float):
    name = cfg_data.name
    if name == "digits":
        from train.data.embedded import digits

        return digits(resolution=cfg_data.resolution)
    if name == "shapes":
        from train.data.embedded import shapes

        return shapes(resolution=cfg_data.resolution, num_images=cfg_data.num_images, seed=cfg_data.seed)
    if name == "fashion_mnist":
        from train.data.fashion_mnist import fashion_mnist

        return fashion_mnist(path=cfg_data.path, split=cfg_data.split, resolution=cfg_data.resolution)
    if name == "latents":
        from train.data.latents import build

        return build(cfg_data, sigma_data)
    if name == "captions":
        from train.data.captioned import CaptionsDataset

        return CaptionsDataset(cfg_data)
    if name == "videos":
        from train.data.video_cache import VideosDataset

        return VideosDataset(cfg_data)
    raise ConfigError(f"data.name='{name}' is unknown; choose data=digits, data=shapes, data=fashion_mnist, data=latents, data=captions "
                      "or data=videos.")
