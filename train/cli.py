"""Turns ConfigError into one clear line on stderr and exit code 2, instead of a traceback."""

from __future__ import annotations

import functools
import sys

from routing import ConfigError


def friendly_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapper
