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
