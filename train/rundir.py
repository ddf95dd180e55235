"""Run-folder rules: one trainer per folder (a lock), and a fresh run never mixes with an old one.

- The main process holds an exclusive `fcntl.flock` on `<run_dir>/.lock` for the life of the run. The
  kernel drops it when the process ends, however it ends, so a killed run leaves no stale lock.
- A fresh run (no `resume=`) into a folder that already holds a run (checkpoints or metrics) is refused,
  unless `overwrite=true`, which moves the old run aside to `<run_dir>.old-<time>/` (nothing is deleted).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from routing import ConfigError

LOCK = ".lock"
KEEP_IN_PLACE = (LOCK, ".hydra")  # the lock, and Hydra's record of this very run (written before the trainer starts)


class RunLock:
    """An exclusive lock on a run folder; `release()` (or the process ending) frees it."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(f"run_dir={str(run_dir)!r} is not writable ({type(err).__name__}: {err.strerror}); "
                              "choose a folder you can write to (e.g. run_dir=runs/exp1).") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise ConfigError(f"run_dir={str(run_dir)!r} is in use by another trainer (pid {holder}); wait for it to "
                              "finish or choose another run_dir.") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def previous_run(run_dir: Path) -> str | None:
    """What an earlier run left in `run_dir` ('checkpoints up to step_0000100', 'metrics up to step 40'), or None."""
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").is_dir() else []
    if ckpts:
        return f"checkpoints up to {ckpts[-1]}"
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
        try:
            return f"metrics up to step {json.loads(lines[-1])['step']}"
        except (ValueError, KeyError, IndexError):
            return "a metrics.jsonl"
    return None


def refuse_or_move_aside(run_dir: Path, overwrite: bool, move: bool) -> Path | None:
    """For a fresh run: refuse a folder holding a run, or (overwrite) move that run aside; returns where it went.

    Every process calls this (so all refuse alike); only the one with `move` moves files."""
    found = previous_run(run_dir)
    if found is None:
        return None
    if not overwrite:
        raise ConfigError(f"run_dir={str(run_dir)!r} already holds a run ({found}); pass resume=auto to continue it, "
                          "overwrite=true to move it aside and start fresh, or choose a new run_dir.")
    aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    if move:
        n = 0
        while aside.exists():
            n += 1
            aside = aside.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        aside.mkdir()
        for entry in run_dir.iterdir():
            if entry.name not in KEEP_IN_PLACE:
                os.replace(entry, aside / entry.name)
    return aside


# Trainers of one process share its lock on a folder (tests and the benchmark build several in turn); the
# lock is released when the last of them lets go.
_HELD: dict[str, list] = {}


class RunDirClaim:
    """This process's share of the lock on a run folder; `release()` is idempotent."""

    def __init__(self, run_dir: Path):
        self.key = os.path.realpath(run_dir)
        if self.key not in _HELD:
            _HELD[self.key] = [RunLock(run_dir), 0]
        _HELD[self.key][1] += 1
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        held = _HELD.get(self.key)
        if held is not None:
            held[1] -= 1
            if held[1] <= 0:
                held[0].release()
                del _HELD[self.key]
