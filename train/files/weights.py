"""A network's weights file: a .safetensors state dict, or a PyTorch file (torch.save; a dict with `state_dict` or
`model` in it is unwrapped as timm does). REPA's frozen encoder reads its `align.weights` through it.

Read whole before any model is built from it: random bytes, an empty file or one cut short is refused in one sentence
naming the file. Whether the tensors fit the named architecture (every key and shape) is checked where the network
is built (train/metrics/encoder.py), so another model's weights are refused too.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import torch

from routing.errors import FileError
from train.files.inception import MAGIC
from train.files.typed import damaged, read_head, read_tensors


def read_weights(path: str | os.PathLike, fix: str) -> dict[str, torch.Tensor]:
    """The tensors of the weights file `path` (name -> tensor, on the CPU)."""
    path = Path(path).expanduser()
    if path.suffix == ".safetensors":
        return read_tensors(path, fix)
    head = read_head(path, fix)
    if not head:
        raise damaged(path, "is empty", fix)
    if not head.startswith(MAGIC):  # safetensors under another name, or neither
        try:
            return read_tensors(path, fix)
        except FileError:
            raise damaged(path, "is neither a safetensors nor a PyTorch weights file", fix) from None
    from timm.models import load_state_dict

    try:
        tensors = load_state_dict(str(path), use_ema=False, weights_only=True)
    except (AttributeError, TypeError):  # timm walks the loaded object as a mapping: something else was saved
        raise damaged(path, "holds no state dict (a mapping of names to tensors)", fix) from None
    except (RuntimeError, EOFError, ValueError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0][:120].rstrip(".")
        raise damaged(path, f"is not a readable PyTorch weights file ({first})", fix) from None
    bad = [name for name, value in tensors.items() if not (isinstance(name, str) and torch.is_tensor(value))] \
        if isinstance(tensors, dict) else None
    if bad is None or bad or not tensors:
        raise damaged(path, "holds no state dict (a mapping of names to tensors)", fix)
    return tensors
