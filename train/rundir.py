"""Run-folder rules: nothing is written before every check has passed, one trainer per folder (a lock), and a
fresh run never mixes with an old one.

- `check_run_dir` refuses a run_dir that cannot hold a run (empty, a file, under a file, not writable) before
  anything happens; Hydra creates no folder and writes no `.hydra/` (configs/config.yaml), the trainer does.
- The lock is taken in two stages (`RunDirClaim`): an existing folder's `<run_dir>/.lock` is locked (without
  writing to it) while the trainer checks its data, model and checkpoint; `commit()`, once every check passed,
  creates the folder and the lock file if needed and records the pid. The main process holds an exclusive
  `fcntl.flock`; the kernel drops it when the process ends, however it ends, so a killed run leaves no stale lock.
- A fresh run (no `resume=`) into a folder that already holds a run (checkpoints or metrics) is refused,
  unless `overwrite=true`, which moves the old run aside to `<run_dir>.old-<time>/` (nothing is deleted).
- `HydraRecord`: what Hydra would have written to `<run_dir>/.hydra/` (config, hydra, overrides) and the
  `train.log` it would have opened, written at commit, so a refused command leaves the folder's record alone.
"""

from __future__ import annotations

import copy
import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from routing import ConfigError
from train.files import read_metrics, read_overrides, write_atomic
from train.files.atomic import stale_temporaries

LOCK = ".lock"
# Folders and files of an existing run that a trainer writes into: each must be writable before training starts.
WRITTEN_DIRS = ("checkpoints", "samples", "tb", ".hydra")
WRITTEN_FILES = (LOCK, "metrics.jsonl")


def check_run_dir(value) -> Path:
    """`run_dir` as a Path, or one sentence saying why it cannot hold a run; nothing is created."""
    text = "" if value is None else str(value)
    example = "choose a folder you can write to (e.g. run_dir=runs/exp1)"
    if not text.strip():
        raise ConfigError(f"run_dir={text!r} is empty, so the run would write into the current folder; {example}.")
    run_dir = Path(text).expanduser()
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        where = "is a file, not a folder" if existing == run_dir else f"lies under {str(existing)!r}, which is a file"
        raise ConfigError(f"run_dir={text!r} {where}; {example}.")
    wanted = [existing] if existing != run_dir else [run_dir, *(run_dir / d for d in WRITTEN_DIRS if (run_dir / d).is_dir())]
    files = [run_dir / f for f in WRITTEN_FILES if (run_dir / f).exists()] if existing == run_dir else []
    for path, mode in [*((d, os.W_OK | os.X_OK) for d in wanted), *((f, os.W_OK) for f in files)]:
        if not os.access(path, mode):
            raise ConfigError(f"run_dir={text!r} is not writable (no write permission on {str(path)!r}, or a read-only disk); "
                              f"{example}, or make it writable.")
    return run_dir


class RunLock:
    """An exclusive lock on a run folder, in two stages (see the module docstring); `release()` frees it."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.path, self._fd = run_dir, run_dir / LOCK, None
        if self.path.is_file():
            self._lock(os.O_RDWR)  # opening it changes nothing; the pid is written at commit

    def _lock(self, flags: int) -> None:
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            raise ConfigError(f"run_dir={str(self.run_dir)!r} is not writable ({type(err).__name__}: {err.strerror}); "
                              "choose a folder you can write to (e.g. run_dir=runs/exp1).") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"run_dir={str(self.run_dir)!r} is in use by another trainer (pid {holder}); wait for it to "
                              "finish or choose another run_dir.") from None
        self._fd = fd

    def commit(self) -> None:
        """Create the folder and its lock file if needed, hold the lock and record this process's pid."""
        if self._fd is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._lock(os.O_RDWR | os.O_CREAT)
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
        try:
            records = read_metrics(metrics)
        except ConfigError:
            return "a metrics.jsonl"
        return f"metrics up to step {records[-1][1]}" if records else "a metrics.jsonl"
    return None


def refuse_used(run_dir: Path, overwrite: bool) -> bool:
    """For a fresh run: refuse a folder holding a run unless `overwrite`; True when that run is to be moved aside."""
    found = previous_run(run_dir)
    if found is not None and not overwrite:
        raise ConfigError(f"run_dir={str(run_dir)!r} already holds a run ({found}); pass resume=auto to continue it, "
                          "overwrite=true to move it aside and start fresh, or choose a new run_dir.")
    return found is not None


def move_aside(run_dir: Path) -> Path:
    """Move the run in `run_dir` (all but the lock) to `<run_dir>.old-<time>/`; returns where it went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = run_dir.with_name(f"{run_dir.name}.old-{stamp}"), 0
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    aside.mkdir()
    for entry in run_dir.iterdir():
        if entry.name != LOCK:
            os.replace(entry, aside / entry.name)
    return aside


# Folders of a run where a kill can leave the temporary file of an atomic write (`.<name>.<pid>.tmp`, train/files/atomic.py):
# the folder itself (metrics.jsonl trimmed on resume, config.yaml), Hydra's record and the sample grids.
TEMPORARY_DIRS = (".", ".hydra", "samples")


def remove_stale_temporaries(run_dir: Path) -> list[str]:
    """Remove the temporary files that killed processes left in `run_dir`'s folders (the pid in the name no longer
    runs; a live writer's stay); returns what it removed, for the log. Called once the trainer holds the folder's lock
    (`_commit`)."""
    done = []
    for tmp in (t for d in TEMPORARY_DIRS for t in stale_temporaries(run_dir / d)):
        tmp.unlink(missing_ok=True)
        done.append(f"removed {tmp.relative_to(run_dir)}")
    return done


# Trainers of one process share its lock on a folder (tests and the benchmark build several in turn); the
# lock is released when the last of them lets go.
_HELD: dict[str, list] = {}


class RunDirClaim:
    """This process's share of the lock on a run folder; `commit()` as RunLock's, `release()` is idempotent."""

    def __init__(self, run_dir: Path):
        self.key = os.path.realpath(run_dir)
        if self.key not in _HELD:
            _HELD[self.key] = [RunLock(run_dir), 0]
        _HELD[self.key][1] += 1
        self.released = False

    def commit(self) -> None:
        _HELD[self.key][0].commit()

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


# What a resume takes from its own command, never from the run's record: where the run is and how to continue it.
COMMAND_ONLY = ("run_dir", "resume", "overwrite")
CONTINUE = ("true", "auto", "latest")


# Config groups (configs/<group>/): choosing another option of one replaces the group's keys.
GROUPS = ("align", "backbone", "data", "experiment", "objective", "routing")


def resumed_overrides(argv: list[str]) -> tuple[list[str], list[str], Path | None, list[str]]:
    """A resume's command line: the overrides its run was started with (<run>/.hydra/overrides.yaml), then this
    command's, which replace them key by key. So `python -m train run_dir=R resume=true` continues R as it was
    started (rwkv, its routes, its batch), and `... trainer.max_steps=4000` changes that key alone; the trainer then
    refuses what may not change on resume, as before. A config group option the command selects (data=fashion_mnist)
    other than the run's (data=videos) replaces the run's whole group, as choosing an option does: the run's keys under
    it (data.frames) are dropped, not applied to the other option's schema. Returns (argv, the overrides taken from the
    run, the record, the notes on the overrides dropped); argv unchanged where the command is no resume, names no run,
    or the run has no record (a fresh `resume=auto`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        given = {o.key_or_group: o for o in parser.parse_overrides([a for a in argv if not a.startswith("-")])}
    except Exception:  # noqa: BLE001 -- a malformed override: composing reports it in one sentence
        return argv, [], None, []
    resume = given.get("resume")
    value = None if resume is None else resume.value()
    text = str(value).lower() if isinstance(value, (bool, str)) else None
    if text is None or text in ("false", "null", "none", "") or (text in CONTINUE and "run_dir" not in given):
        return argv, [], None, []
    run = Path(str(given["run_dir"].value())) if text in CONTINUE else Path(str(value)).parent.parent  # a checkpoint's run
    record = run.expanduser() / ".hydra" / "overrides.yaml"
    if not record.is_file():
        return argv, [], None, []
    saved = read_overrides(record)
    parsed = parser.parse_overrides(saved)
    keys = [o.key_or_group for o in parsed]
    # Groups whose option the command changes: the run's keys under them belong to the run's option, not the new one.
    choices = _run_choices(run.expanduser(), parsed)
    changed = {}
    for group, o in given.items():
        chosen = None if group not in GROUPS or o.is_delete() else str(o.value())
        if chosen is not None and choices.get(group) not in (None, chosen):
            changed[group] = (choices[group], chosen)
    kept, dropped = [], {}
    for o, key in zip(saved, keys):
        if key in given or key in COMMAND_ONLY:
            continue
        group = next((g for g in changed if key.startswith(g + ".")), None)
        if group is not None:
            dropped.setdefault(group, []).append(o)
        else:
            kept.append(o)
    notes = [f"not {' '.join(lines)}: keys of the run's {group}={changed[group][0]}, which {group}={changed[group][1]} "
             "replaces (a new option starts from its own defaults)" for group, lines in dropped.items()]
    first = next(i for i, a in enumerate(argv) if not a.startswith("-") and "=" in a)  # Hydra reads overrides in one run
    return [*argv[:first], *kept, *argv[first:]], kept, record, notes


def _run_choices(run: Path, saved: list) -> dict[str, str]:
    """The option of each config group a run was trained with: Hydra's record (.hydra/hydra.yaml, its runtime choices),
    else the group options of its overrides (a group it did not select is then unknown, and its keys stay)."""
    choices = {o.key_or_group: str(o.value()) for o in saved if o.key_or_group in GROUPS and not o.is_delete()}
    try:
        recorded = OmegaConf.select(OmegaConf.load(run / ".hydra" / "hydra.yaml"), "hydra.runtime.choices")
        recorded = {str(k): str(v) for k, v in OmegaConf.to_container(recorded).items()
                    if k in GROUPS and v is not None}
    except Exception:  # noqa: BLE001 -- no or a damaged record: the overrides are what is known
        recorded = {}
    return {**choices, **recorded}


@dataclass
class HydraRecord:
    """What Hydra writes to `<output dir>/.hydra/` before a job, kept until the trainer's checks have passed."""

    config: DictConfig  # the job's config (.hydra/config.yaml)
    hydra: DictConfig  # Hydra's own config, under a `hydra` key (.hydra/hydra.yaml)
    overrides: list  # the command line's overrides (.hydra/overrides.yaml)

    @classmethod
    def current(cls, cfg: DictConfig) -> HydraRecord:
        """The record of the Hydra job this process runs (call from inside the Hydra task function)."""
        from hydra.core.hydra_config import HydraConfig

        hydra = copy.deepcopy(HydraConfig.instance().cfg)
        return cls(cfg, hydra, OmegaConf.to_container(hydra.hydra.overrides.task))

    def write(self, run_dir: Path, key: str = "run_dir") -> None:
        """`.hydra/` as Hydra writes it, with the run folder (config key `key`) as the output folder, and `<job>.log`
        from now on."""
        hydra = OmegaConf.create(OmegaConf.to_container(self.hydra))  # a plain copy, interpolations kept as written
        # As Hydra records a job it ran in the run folder.
        hydra.hydra.run.dir = f"${{{key}}}"
        hydra.hydra.output_subdir = ".hydra"
        hydra.hydra.runtime.output_dir = os.path.abspath(run_dir)
        folder = run_dir / ".hydra"
        folder.mkdir(exist_ok=True)
        for name, node in (("config.yaml", self.config), ("hydra.yaml", hydra), ("overrides.yaml", self.overrides)):
            write_atomic(folder / name, OmegaConf.to_yaml(node))
        root = logging.getLogger()
        handler = logging.FileHandler(run_dir / f"{hydra.hydra.job.name}.log")
        handler.setFormatter(root.handlers[0].formatter if root.handlers else None)  # Hydra's job_logging format
        root.addHandler(handler)
