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


def same_settings(saved, current, defaults=None) -> bool:
    """True when a result measured under `saved` settings holds for the `current` ones.

    Keys the project gained after the result was measured are missing from `saved`. Such a key matches when its
    current value is the one the plain config gives it (`defaults`, the same nesting as `current`): a new key's
    default keeps what ran before, which is the project's rule for every new key, so committed results stay
    reusable as the code grows. Any other difference, a removed key included, does not match.
    """
    if isinstance(saved, dict) and isinstance(current, dict):
        defaults = defaults if isinstance(defaults, dict) else {}
        if set(saved) - set(current):
            return False
        return all(same_settings(saved[k], v, defaults.get(k)) if k in saved else (k in defaults and defaults[k] == v)
                   for k, v in current.items())
    return saved == current


def _read(path: Path) -> dict | None:
    """A saved result, or None when there is none or it is damaged (then it is measured again)."""
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except json.JSONDecodeError:
        return None


def saved_result(path: Path, settings: dict, defaults: dict | None = None) -> dict | None:
    """The result saved at `path` if it was measured with `settings` (see same_settings), else None."""
    settings, defaults = json.loads(json.dumps([settings, defaults]))  # JSON-normal form (tuples -> lists), as read back
    saved = _read(path)
    return saved if saved is not None and same_settings(saved.get("settings"), settings, defaults) else None


def saved_subset(path: Path, settings: dict, key: str, defaults: dict | None = None) -> dict | None:
    """The result saved at `path`, narrowed to the entries that `settings[key]` names, if it measured every one of them
    (and everything else) under the same settings; else None. So a bench over a sub-grid reuses the costs measured for
    a bigger grid, and leaves that file as it was: each speedup is a ratio of two cells timed in the same rounds."""
    settings, defaults = json.loads(json.dumps([settings, defaults]))  # JSON-normal form, as read back
    saved = _read(path)
    measured = ((saved or {}).get("settings") or {}).get(key) or {}
    if not measured or not set(settings[key]) <= set(measured):
        return None
    narrowed = saved["settings"] | {key: {k: measured[k] for k in settings[key]}}
    if not same_settings(narrowed, settings, defaults):
        return None
    return saved | {key: {k: saved[key][k] for k in settings[key]}}


def reuse_or_compute(path: Path, settings: dict, compute: Callable[[], dict], what: str, defaults: dict | None = None) -> dict:
    """The result saved at `path` if it was measured with `settings` (see same_settings), else `compute()` (then saved)."""
    saved = saved_result(path, settings, defaults)
    if saved is not None:
        log.info(f"reused {what} from {path}")
        return saved
    if path.exists():
        log.info(f"{path} was measured with other settings; measuring {what} again")
    result = {"settings": json.loads(json.dumps(settings)), **compute()}
    write_json_atomic(path, result)
    return result
