"""Resumable units: each measurement is saved atomically with the settings it was made under, and reused."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)  # a killed run leaves the old file or the new one, never half of one


def saved_result(path: Path, settings: dict) -> dict | None:
    """The result saved at `path` if it was measured with exactly `settings`, else None."""
    settings = json.loads(json.dumps(settings))  # JSON-normal form (tuples -> lists), as it is read back
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return saved if saved.get("settings") == settings else None


def reuse_or_compute(path: Path, settings: dict, compute: Callable[[], dict], what: str) -> dict:
    """The result saved at `path` if it was measured with exactly `settings`, else `compute()` (then saved)."""
    saved = saved_result(path, settings)
    if saved is not None:
        log.info(f"reused {what} from {path}")
        return saved
    if path.exists():
        log.info(f"{path} was measured with other settings; measuring {what} again")
    result = {"settings": json.loads(json.dumps(settings)), **compute()}
    write_json_atomic(path, result)
    return result
