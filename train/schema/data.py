"""`data:` one schema per dataset (the keys differ), picked by `data.name` and checked by `check_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

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
    normalize: str = key("auto", "auto: scale when fine-tuning, else standardize | standardize: per-channel std sigma_data | scale: the "
                         "VAE's (z - shift) * scaling", choices=("auto", "standardize", "scale"), example="scale")
    vae: Optional[str] = key(None, "VAE for decoding sample grids (null: the one in meta.json)", example="/weights/sd-vae-ft-ema")


@dataclass
class CaptionsData:
    """Captioned images (name.png + name.txt, sub-folders allowed), bucketed by aspect ratio, for fine-tuning text-to-image models."""

    name: str = key("captions", "dataset", example="captions")
    path: Optional[str] = key(None, "folder of images with a .txt caption beside each (required)", example="/data/my-set")
    resolution: int = key(256, "bucket area in pixels: about resolution x resolution per image", ge=8, le=8192, example=1024)
    alignment: int = key(64, "bucket sides are multiples of this (a multiple of the VAE factor x the model's patch)", ge=1,
                         le=1024, example=64)
    aspect_ratios: List[float] = key([1.0, 1.333, 0.75, 1.5, 0.667, 1.778, 0.5625], "bucket aspect ratios (width / height); each "
                                     "image goes to the nearest", gt=0, le=16, example="[1.0,1.5,0.667]")
    pipeline: Optional[str] = key(None, "diffusers pipeline folder whose text encoders (and vae/) encode the data (null: finetune.pretrained)",
                                  example="weights/FLUX.1-dev")
    vae: Optional[str] = key(None, "VAE folder (null: the pipeline's vae/), or pixels to train on the images themselves", example="pixels")
    channels: int = key(3, "image channels with vae=pixels: 3 (RGB) or 1 (grey)", ge=1, le=3, example=1)
    max_sequence_length: Optional[int] = key(None, "text tokens per caption (null: the pipeline's)", ge=1, le=4096, example=77)
    cache: Optional[str] = key(None, "cache folder of the encoded captions and latents (null: <path>/.tread_cache)", example="/cache/my-set")
    mask_loss_weight: Optional[List[float]] = key(None, "[inside, outside]: loss weights inside and outside each image's name.mask.png "
                                                  "(null: 1 everywhere; its tokens are force-kept either way)", ge=0, le=1000,
                                                  length=2, example="[1.0,0.0]")


@dataclass
class VideosData:
    """Captioned clips or frame folders (name.mp4 + name.txt, name/0001.png ... + name.txt), for fine-tuning Wan."""

    name: str = key("videos", "dataset", example="videos")
    path: Optional[str] = key(None, "folder of clips (.mp4 .gif .webm ...) or frame folders, a .txt caption beside each (required)",
                              example="/data/my-clips")
    frames: int = key(17, "frames per sample: 1 + 4k for Wan's VAE (81 is Wan's own length; 1 trains single frames)", ge=1, le=1025,
                      example=33)
    stride: int = key(1, "take every stride-th frame of a clip", ge=1, le=64, example=2)
    height: int = key(480, "frame height in pixels after a centre crop (a multiple of the VAE factor 8 x the patch 2)", ge=8, le=4096,
                      example=480)
    width: int = key(832, "frame width in pixels after a centre crop (a multiple of 16 for Wan)", ge=8, le=4096, example=832)
    pipeline: Optional[str] = key(None, "Wan pipeline folder whose text encoder (and vae/) encode the data (null: finetune.pretrained)",
                                  example="weights/Wan2.1-T2V-1.3B-Diffusers")
    vae: Optional[str] = key(None, "AutoencoderKLWan folder (null: the pipeline's vae/), or pixels to train on the frames", example="pixels")
    max_sequence_length: Optional[int] = key(None, "text tokens per caption (null: the pipeline's 512)", ge=1, le=4096, example=226)
    cache: Optional[str] = key(None, "cache folder of the encoded captions and latents (null: <path>/.tread_cache)", example="/cache/clips")
    mask_loss_weight: Optional[List[float]] = key(None, "[inside, outside]: loss weights inside and outside each frame's mask "
                                                  "(name.mask.png beside a clip, 0001.mask.png beside a frame; null: 1 everywhere)",
                                                  ge=0, le=1000, length=2, example="[1.0,0.0]")


DATA = {"digits": DigitsData, "shapes": ShapesData, "fashion_mnist": FashionMNISTData, "latents": LatentsData, "captions": CaptionsData,
        "videos": VideosData}
