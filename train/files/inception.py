"""The Inception-v3 weights file FID reads (torch-fidelity's `weights-inception-2015-12-05-*.pth`).

Only its kind is checked here (a readable file in PyTorch's format); train/metrics/inception.py loads it, and
refuses weights that do not fit the network in one sentence too.
"""

from __future__ import annotations

import os
from pathlib import Path

from train.files.typed import damaged, read_head

# torch.save writes a zip archive; files from before PyTorch 1.6 are a pickle stream (protocol 2+ starts with 0x80).
MAGIC = (b"PK\x03\x04", b"\x80")


def check_weights(path: str | os.PathLike, fix: str) -> Path:
    path = Path(path).expanduser()
    head = read_head(path, fix)
    if not head.startswith(MAGIC):
        raise damaged(path, "is empty" if not head else "is not a PyTorch weights file", fix)
    return path
