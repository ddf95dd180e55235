"""Cells shared by several bench processes: a process trains a cell only while it holds the cell's claim.

Start the same bench command in several processes (one thread each on a CPU) and each takes the next cell that is
neither measured nor claimed, so no cell is trained twice and no process idles while cells remain, whatever their
lengths. A claim is a file holding the owner's pid, created atomically; a claim whose process has died (killed,
machine restarted) is stale and taken over, and the cell then continues from its last checkpoint. What every process
needs before its cells, the scoring classifier, is claimed too (`waiting_claim`): one process trains it, the others wait
for it and load it from the cache.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from train.files.atomic import pid_running


def owner(path: Path) -> int | None:
    """The pid of the live process holding the claim at `path`, else None (no claim, or a stale one)."""
    try:
        pid = int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid and pid != os.getpid() and pid_running(pid) else None


@contextmanager
def claim(path: Path) -> Iterator[int | None]:
    """Hold the claim at `path` for the block; yields None when held, or the pid of the live process that holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = owner(path)
    if holder is not None:
        yield holder
        return
    path.unlink(missing_ok=True)  # stale, or ours from before
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another process claimed it between our check and our create
        yield owner(path) or -1
        return
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    try:
        yield None
    finally:
        path.unlink(missing_ok=True)


@contextmanager
def waiting_claim(path: Path, log: Callable[[str], None] = print, poll_s: float = 1.0) -> Iterator[None]:
    """Hold the claim at `path` for the block, waiting (one line said) while another live process holds it."""
    said = False
    while True:
        with claim(path) as holder:
            if holder is None:
                yield
                return
        if not said:
            log(f"waiting for pid {holder}, which holds {path}; it trains what this process would load")
            said = True
        time.sleep(poll_s)
