"""Fashion-MNIST (Xiao et al. 2017) from its original idx files: 28x28 grayscale clothes, 10 classes.

Debian's `dataset-fashion-mnist` package installs the four files in /usr/share/datasets/fashion-mnist/
(train: 60,000 images, t10k: 10,000). Images are padded 28 -> 32 with the background value, so patch 2
gives a 16x16 grid of 256 tokens, the token count of ImageNet 256 latents in the TREAD paper.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from routing.errors import ConfigError
from train.data.embedded import TensorDataset

DEFAULT_PATH = "/usr/share/datasets/fashion-mnist"
PREFIX = {"train": "train", "test": "t10k"}  # split name -> file prefix of the original release
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IDX_DTYPE = {0x08: np.uint8}  # idx type codes this dataset uses (unsigned bytes)


def read_idx(path: Path) -> np.ndarray:
    """An idx file (optionally gzipped) as an array: magic 0x0000 <type> <ndim>, then ndim big-endian sizes."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:  # a damaged or cut .gz
        raise ConfigError(f"'{path}' cannot be read ({type(err).__name__}); download it again or check data.path.") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPE or len(raw) < 4 + 4 * raw[3]:
        raise ConfigError(f"'{path}' is not an unsigned-byte idx file; check data.path.")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=IDX_DTYPE[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ConfigError(f"'{path}' holds {data.size} values but its header says {dims}; the file is truncated.")
    return data.reshape(dims)  # flat bytes -> (n,) labels or (n, 28, 28) images


def _find(root: Path, stem: str) -> Path | None:
    """The gzipped file of the original release, or the same file unpacked."""
    for name in (f"{stem}.gz", stem):
        if (root / name).is_file():
            return root / name
    return None


def fashion_mnist(path: str = DEFAULT_PATH, split: str = "train", resolution: int = 32) -> TensorDataset:
    """One split as [-1, 1] images (n, 1, resolution, resolution), the 28x28 originals centred on -1 padding."""
    if split not in PREFIX:
        raise ConfigError(f"data.split='{split}' is unknown; choose data.split=train or data.split=test.")
    if resolution < 28 or resolution % 2:
        raise ConfigError(f"data.resolution={resolution} must be even and at least 28 (the images are 28x28, padded).")
    root = Path(path).expanduser()
    files = {kind: _find(root, f"{PREFIX[split]}-{kind}-idx{dim}-ubyte") for kind, dim in (("images", 3), ("labels", 1))}
    if None in files.values():
        raise ConfigError(f"Fashion-MNIST {split} files are missing in '{root}': run `apt-get install dataset-fashion-mnist` "
                          f"or set data.path to the folder holding {PREFIX[split]}-images-idx3-ubyte.gz and its labels.")
    images, labels = read_idx(files["images"]), read_idx(files["labels"])
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ConfigError(f"'{root}' holds images {images.shape} and labels {labels.shape}; expected (n, H, W) and (n,).")
    if labels.size and labels.max() >= len(CLASSES):  # a label past the last class would index past the null label
        raise ConfigError(f"'{files['labels']}' holds label {int(labels.max())}, but Fashion-MNIST has {len(CLASSES)} classes "
                          f"(0-{len(CLASSES) - 1}); the file is damaged or from another dataset, so check data.path.")
    x = torch.from_numpy(images.astype(np.float32) / 127.5 - 1)[:, None]  # (n, H, W) -> (n, 1, H, W) in [-1, 1]
    # Pad with -1 (black, the clothes' background) so the object stays centred and the border is plain background.
    top, left = (resolution - x.shape[-2]) // 2, (resolution - x.shape[-1]) // 2
    x = F.pad(x, (left, resolution - x.shape[-1] - left, top, resolution - x.shape[-2] - top), value=-1.0)
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)), len(CLASSES), f"fashion_mnist-{split}")
