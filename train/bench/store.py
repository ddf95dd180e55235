"""Resumable units: each measurement is saved atomically with the settings it was made under, and reused."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from routing import ConfigError
from train.files import write_atomic

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, obj: dict) -> None:
    # A killed run leaves the old file or the new one, never half of one; the temporary carries the pid, so two
    # bench processes sharing a results folder (the bench's two-shell mode) never write the same temporary.
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(obj, indent=1))


# Values whose spelling changed after results were measured, by key: the old spelling means the new one (the trainer
# reads both alike, train.compiling.compile_mode), so committed results measured before the change stay reusable.
RESPELLED = {"compile": {False: "off", True: "blocks"}}


def same_settings(saved, current, defaults=None, key: str | None = None) -> bool:
    """True when a result measured under `saved` settings holds for the `current` ones.

    Keys the project gained after the result was measured are missing from `saved`. Such a key matches when its
    current value is the one the plain config gives it (`defaults`, the same nesting as `current`): a new key's
    default keeps what ran before, which is the project's rule for every new key, so committed results stay
    reusable as the code grows; so does a value in its old spelling (RESPELLED). Any other difference, a removed key
    included, does not match.
    """
    if isinstance(saved, dict) and isinstance(current, dict):
        defaults = defaults if isinstance(defaults, dict) else {}
        if set(saved) - set(current):
            return False
        return all(same_settings(saved[k], v, defaults.get(k), k) if k in saved else (k in defaults and defaults[k] == v)
                   for k, v in current.items())
    respelled = RESPELLED.get(key, {})
    return saved == current or (isinstance(saved, bool) and saved in respelled and respelled[saved] == current)


def _read(path: Path, key: str | None = None) -> dict | None:
    """A saved result, or None when there is none or it is not JSON (damaged: then it is measured again). Valid JSON
    of another shape is refused (check_result): it is not a half-written result but someone's file, kept as it is."""
    try:
        saved = json.loads(path.read_text()) if path.exists() else None
    except ValueError:  # not JSON, or not UTF-8 text
        return None
    if saved is not None:
        check_result(path, saved, key)
    return saved


def check_result(path: Path, saved, key: str | None = None) -> None:
    """Refuse, in one sentence, JSON that is not a result this bench wrote: an object with a `settings` object and,
    for `key` (cost.json's "cells"), an object of one object per cell in both the result and its settings."""
    def cells(node) -> bool:
        return isinstance(node, dict) and all(isinstance(v, dict) for v in node.values())

    shaped = isinstance(saved, dict) and isinstance(saved.get("settings"), dict)
    if shaped and key is not None:
        shaped = cells(saved.get(key)) and cells(saved["settings"].get(key))
    if not shaped:
        what = f"an object with 'settings' and '{key}' objects" if key else "an object with a 'settings' object"
        raise ConfigError(f"{path} is JSON but not a result this bench wrote ({what}); move it aside (or delete it) and run "
                          "the command again to measure it anew.")


def check_saved(results: Path) -> None:
    """Before a bench writes anything: every saved result under `results` (cost.json, cells/*.json) it may reuse is
    a result or damaged beyond JSON, never someone else's JSON (check_result)."""
    _read(results / "cost.json", "cells")
    for path in sorted((results / "cells").glob("*.json")):
        _read(path)


def cost_cells(path: Path) -> dict:
    """The per-cell costs of a bench's cost.json (train.speedups_from); ValueError if it is not one."""
    saved = json.loads(path.read_text())
    # Only the per-cell costs are read, so a file of costs alone (no measured settings) is enough.
    cells = saved.get("cells") if isinstance(saved, dict) else None
    if not (isinstance(cells, dict) and all(isinstance(v, dict) for v in cells.values())):
        raise ValueError(f"{path} is JSON but not a bench's cost.json (an object with a 'cells' object of one object "
                         "per cell)")
    return cells


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
    saved = _read(path, key)
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
