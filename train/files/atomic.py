"""Writing a file whole or not at all: a temporary file beside it, flushed to disk, then renamed over it.

A kill, or a disk that fills, leaves the old file or the new one, never a cut one, and no temporary file.
torch and safetensors report a failed write (a full disk) with their own exception types; it is raised as
an OSError naming the file, which the commands turn into one sentence (train/cli.py).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: str | bytes | Callable[[Path], None]) -> None:
    """Write `data` (text, bytes, or a function that writes the file at the path it is given) to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if callable(data):
            data(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        else:
            with open(tmp, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        raise
    except Exception as err:
        raise as_os_error(err, path) from err
    finally:
        tmp.unlink(missing_ok=True)


# torch.save says only "unexpected pos ..." when the disk fills: less free space than this after a failed write
# (before its partial file is removed) is taken as a full disk.
NEARLY_FULL = 16 << 20


def as_os_error(err: BaseException, path: str | os.PathLike) -> OSError:
    """A library's failed write as an OSError on `path` (ENOSPC when the disk is full); call before cleaning up."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    full = "No space left on device" in str(err) or "os error 28" in str(err)
    if not full:
        folder = next((p for p in Path(path).parents if p.exists()), None)
        full = folder is not None and shutil.disk_usage(folder).free < NEARLY_FULL
    return OSError(errno.ENOSPC if full else errno.EIO, f"{type(err).__name__}: {text}", str(path))


def pid_running(pid: int) -> bool:
    """Whether process `pid` runs (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_temporaries(folder: Path, pid_last: bool = False) -> list[Path]:
    """The temporary files of writes in `folder` whose process no longer runs, so nothing will rename them: a kill left
    them. `.<name>.<pid>.tmp` as write_atomic names them; with `pid_last` also `.<name>.<pid>` (the caches' writes)."""
    found = []
    for path in sorted(folder.glob(".*")) if folder.is_dir() else []:
        parts = path.name.removesuffix(".tmp").rsplit(".", 1) if path.name.endswith(".tmp") or pid_last else []
        if len(parts) == 2 and parts[1].isdigit() and path.is_file() and not pid_running(int(parts[1])):
            found.append(path)
    return found
