"""Aspect-ratio buckets: a few image sizes of about equal area, one per aspect ratio, and the batch schedule over them.

Every image goes to the bucket whose aspect ratio is nearest its own (in log ratio), and is resized to cover the
bucket and centre-cropped to it. A global batch always comes from one bucket, so the latents of a batch share
one shape, and a transformer's token grid (its rotary ids, its routes) is that bucket's grid.

The schedule is a pure function of (seed, step), like the trainer's other draws: per epoch, each bucket's images
are permuted and cut into batches (the last one filled up from the start of the same permutation, so every image
is seen every epoch and a bucket smaller than a batch still trains), and the epoch's batches are shuffled. A
resumed run therefore repeats the batches of an uninterrupted one.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from PIL import Image

Size = tuple[int, int]  # (width, height) in pixels


def bucket_sizes(resolution: int, alignment: int, aspect_ratios) -> list[Size]:
    """(width, height) per aspect ratio (width / height): multiples of `alignment`, area near resolution^2."""
    sizes = []
    for ratio in aspect_ratios:
        width = max(alignment, round(resolution * math.sqrt(ratio) / alignment) * alignment)
        height = max(alignment, round(resolution / math.sqrt(ratio) / alignment) * alignment)
        if (width, height) not in sizes:
            sizes.append((width, height))
    return sizes


def nearest_bucket(size: Size, buckets: list[Size]) -> int:
    """Index of the bucket whose aspect ratio is nearest the image's (ties: the first)."""
    ratio = math.log(size[0] / size[1])
    return min(range(len(buckets)), key=lambda b: abs(math.log(buckets[b][0] / buckets[b][1]) - ratio))


def fit_to_bucket(image: Image.Image, size: Size, resample=Image.Resampling.BICUBIC) -> Image.Image:
    """Resize to cover `size` (aspect kept), then crop the centre: the whole bucket is image, none is padding."""
    width, height = size
    # Box-halve while twice too big, so the final bicubic step does not alias (as the ADM centre crop does).
    while image.width >= 2 * width and image.height >= 2 * height:
        image = image.resize((image.width // 2, image.height // 2), resample=Image.Resampling.BOX)
    scale = max(width / image.width, height / image.height)
    image = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))),
                         resample=resample)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return image.crop((left, top, left + width, top + height))


def fit_frame(image: Image.Image, size: Size, resample=Image.Resampling.BICUBIC) -> Image.Image:
    """Centre-crop to the aspect of `size`, then resize to it: a video frame's fit (one crop for every frame)."""
    (width, height), (w, h) = size, image.size
    scale = max(width / w, height / h)
    crop_w, crop_h = round(width / scale), round(height / scale)
    left, top = (w - crop_w) // 2, (h - crop_h) // 2
    return image.crop((left, top, left + crop_w, top + crop_h)).resize((width, height), resample)


def _generator(*keys: int) -> torch.Generator:
    # The trainer's `seeded` formula, so the data order is a pure function of (seed, epoch, ...).
    return torch.Generator().manual_seed(hash(tuple(keys)) % (2**63))


class BucketSchedule:
    """Global batches drawn from one bucket each: `batch(seed, step, size)` -> dataset indices (size,)."""

    def __init__(self, bucket_of: list[int]):
        members: dict[int, list[int]] = {}
        for index, bucket in enumerate(bucket_of):
            members.setdefault(bucket, []).append(index)
        self.members = {b: torch.tensor(ix) for b, ix in sorted(members.items())}

    def batches_per_epoch(self, size: int) -> int:
        return sum(math.ceil(len(ix) / size) for ix in self.members.values())

    @lru_cache(maxsize=4)
    def epoch(self, seed: int, epoch: int, size: int) -> list[torch.Tensor]:
        batches = []
        for bucket, ix in self.members.items():
            order = ix[torch.randperm(len(ix), generator=_generator(seed, epoch, 6, bucket))]
            count = math.ceil(len(order) / size)
            filled = order.repeat(math.ceil(count * size / len(order)))[: count * size]  # the last batch wraps around
            batches += list(filled.view(count, size))  # (count * size,) -> count batches of (size,)
        return [batches[i] for i in torch.randperm(len(batches), generator=_generator(seed, epoch, 7)).tolist()]

    def batch(self, seed: int, step: int, size: int) -> torch.Tensor:
        per_epoch = self.batches_per_epoch(size)
        return self.epoch(seed, step // per_epoch, size)[step % per_epoch]
