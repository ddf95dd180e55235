"""A prompt table's safetensors header: format, family, the class prompts, and each tensor's shape.

Reading the header costs nothing (safetensors opens it without the tensors), so a training run checks its
table at start-up, before the pretrained model loads; train/data/prompts.py reads the tensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from train.files.typed import damaged

FORMAT = "tread-zoo-prompts/1"
WRITE_ONE = "write one with `python -m train.encode_prompts` (docs/finetuning.md)"


@dataclass
class TableHeader:
    family: str
    prompts: list[str]  # K + 1 texts; the last is "" (the null class)
    source: str
    stand_in: bool
    shapes: dict[str, list[int]]  # tensor name -> shape


def read_header(path: str | os.PathLike) -> TableHeader:
    path = Path(path).expanduser()
    if not path.is_file():
        raise damaged(path, "is not a file" if path.exists() else "does not exist", WRITE_ONE)
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as err:  # a damaged file: safetensors raises several types
        raise damaged(path, f"is not a readable safetensors file ({type(err).__name__})", WRITE_ONE) from None
    if metadata.get("format") != FORMAT:
        raise damaged(path, f"is not a prompt table (format {metadata.get('format')!r}, expected {FORMAT!r})", WRITE_ONE)
    try:
        prompts = json.loads(metadata.get("prompts", ""))
    except json.JSONDecodeError:
        prompts = None
    if not isinstance(prompts, list) or len(prompts) < 2 or not all(isinstance(p, str) for p in prompts) or prompts[-1] != "":
        raise damaged(path, "has no valid 'prompts' list (the class prompts, then the empty prompt)", WRITE_ONE)
    if not metadata.get("family"):
        raise damaged(path, "names no model family", WRITE_ONE)
    rows = {name: shape[0] if shape else 0 for name, shape in shapes.items()}
    if set(rows.values()) != {len(prompts)}:
        raise damaged(path, f"holds {rows} rows for {len(prompts)} prompts", WRITE_ONE)
    return TableHeader(metadata["family"], prompts, metadata.get("source", ""), metadata.get("stand_in") == "true", shapes)
