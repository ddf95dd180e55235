"""Reading a file a model package loads (a LoRA folder's records and tensors, an encoder's weights), each fault as
one sentence naming the file and the fix: a FileError (a ConfigError, so the commands print it in one line and exit
with code 2).

backbones cannot import train (the layer contract), so these readers live here, the lowest package that loads
files; train/files re-exports them for its loaders of the training's own files (run state, metrics, latents).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from routing.errors import FileError

__all__ = ["damaged", "read_config", "read_head", "read_json", "read_tensors", "read_text", "safetensors_metadata", "tensor_shapes"]


def damaged(path: str | os.PathLike, problem: str, fix: str) -> FileError:
    """'<path>' <problem>; <fix>. — the one sentence every loader refuses a file with."""
    return FileError(f"'{path}' {problem}; {fix}.")


def _read(path: str | os.PathLike, fix: str, read: Callable[[Path], Any]) -> Any:
    """read(path), with a missing, unreadable or binary file refused."""
    try:
        return read(Path(path))
    except FileNotFoundError:
        raise damaged(path, "does not exist", fix) from None
    except IsADirectoryError:
        raise damaged(path, "is a folder, not a file", fix) from None
    except PermissionError:
        raise damaged(path, "cannot be read (permission denied)", fix) from None
    except UnicodeDecodeError:
        raise damaged(path, "is not a text file", fix) from None
    except OSError as err:
        raise damaged(path, f"cannot be read ({err.strerror or type(err).__name__})", fix) from None


def read_text(path: str | os.PathLike, fix: str) -> str:
    """The UTF-8 text of `path`; a missing, unreadable or binary file is refused."""
    return _read(path, fix, lambda p: p.read_text(encoding="utf-8"))


def read_head(path: str | os.PathLike, fix: str, size: int = 8) -> bytes:
    """The first `size` bytes of `path` (b"" when it is empty), to tell a file's kind by them; a missing or unreadable
    file is refused."""
    def head(p: Path) -> bytes:
        with open(p, "rb") as f:
            return f.read(size)

    return _read(path, fix, head)


def read_json(path: str | os.PathLike, fix: str) -> Any:
    """The JSON value in `path`; a truncated or hand-broken file is refused with where it stops parsing."""
    text = read_text(path, fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        where = "is empty" if not text.strip() else f"is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        raise damaged(path, where, fix) from None


REFETCH = "fetch the model again (a download that stopped, or an edit, leaves such a file)"


def read_config(path: str | os.PathLike, fix: str = REFETCH) -> dict:
    """A pretrained model's JSON config (config.json, model_index.json): a JSON object, or a refusal naming the file."""
    config = read_json(path, fix)
    if not isinstance(config, dict):
        raise damaged(path, "is not a JSON object (a model's config)", fix)
    return config


def _safetensors_fault(path: Path, err: BaseException) -> str:
    """What is wrong with a file safetensors could not open, in words: empty, cut short, or not safetensors at all."""
    size = path.stat().st_size
    if size == 0:
        return "is empty"
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    reason = reason.removeprefix("Error while deserializing header: ").rstrip(".")
    if size < 8 or "header too large" in reason or "invalid" in reason.lower() or "utf" in reason.lower():
        return f"is not a safetensors file ({reason})"
    return f"is cut short or damaged ({reason})"


def _open_safetensors(path: Path, fix: str, read) -> Any:
    if not path.is_file():
        raise damaged(path, "is a folder, not a file" if path.is_dir() else "does not exist", fix)
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return read(f)
    except OSError as err:
        if err.errno is not None:  # the file system's fault, not the file's
            raise damaged(path, f"cannot be read ({err.strerror or type(err).__name__})", fix) from None
        raise damaged(path, _safetensors_fault(path, err), fix) from None
    except Exception as err:  # safetensors raises SafetensorError (and others) for a damaged file
        raise damaged(path, _safetensors_fault(path, err), fix) from None


def read_tensors(path: str | os.PathLike, fix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `path`, on the CPU; an empty, truncated or foreign file is refused."""
    path = Path(path).expanduser()
    tensors = _open_safetensors(path, fix, lambda f: {name: f.get_tensor(name) for name in f.keys()})
    if not tensors:
        raise damaged(path, "holds no tensors", fix)
    return tensors


def tensor_shapes(path: str | os.PathLike, fix: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of the tensors in the safetensors file `path`, from its header alone (safetensors checks that
    the file covers every tensor the header lists, so a file cut short is refused without reading its data)."""
    path = Path(path).expanduser()
    return _open_safetensors(path, fix, lambda f: {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})


def safetensors_metadata(path: str | os.PathLike, fix: str) -> dict[str, str]:
    """The string metadata of the safetensors file `path` ({} when it has none), after the same checks as tensor_shapes."""
    path = Path(path).expanduser()
    return _open_safetensors(path, fix, lambda f: f.metadata() or {})
