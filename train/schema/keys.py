"""`key()`: one dataclass field of the schema, carrying its help text, allowed range and resume rule.

Declaring a config key is one line in the group's dataclass:

    warmup_steps: int = key(0, "linear lr warm-up length in optimizer steps", ge=0, example=1000)

Hydra then checks its type when the config is composed, `check_config` checks its range before any
work starts, `python -m train --help` prints its help, and the schema tests generate a wrong-type and an
out-of-range case for it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

# What a resumed run does when a key differs from the checkpoint's config.
APPLY = "apply"  # the new value is used, and the change is printed
REFUSE = "refuse"  # resuming is refused: the value changes what the saved weights mean


def key(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None, choices: tuple | None = None, length: int | None = None, example: Any = None,
        on_resume: str = APPLY) -> Any:
    """A schema field: default, help text, range (ge/gt/le/lt, of each item for a list), allowed values, the
    number of items of a list, an example and the resume rule."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "length": length, "example": example,
            "on_resume": on_resume}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def group(cls: type, help: str) -> Any:
    """A nested group (a dataclass) as a field of its parent."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


def describe_range(meta: dict) -> str:
    """'> 0', 'in [0, 1)', 'one of no, bf16, fp16', ... ('' when unbounded)."""
    if meta.get("choices"):
        return "one of " + ", ".join(str(c) for c in meta["choices"])
    low = ("[", meta["ge"]) if meta.get("ge") is not None else ("(", meta["gt"]) if meta.get("gt") is not None else None
    high = ("]", meta["le"]) if meta.get("le") is not None else (")", meta["lt"]) if meta.get("lt") is not None else None
    if low and high:
        return f"in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {_num(low[1])}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {_num(high[1])}"
    return ""


def in_range(value: float, meta: dict) -> bool:
    """Within the key's bounds, and finite: no key means anything by inf or NaN (align.weight=inf would skip every
    step as non-finite)."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    checks = (("ge", lambda b: value >= b), ("gt", lambda b: value > b), ("le", lambda b: value <= b), ("lt", lambda b: value < b))
    return all(meta.get(name) is None or ok(meta[name]) for name, ok in checks)


def out_of_range_example(meta: dict) -> float | None:
    """A value just outside the range (for the generated tests); None when the key is unbounded."""
    if meta.get("ge") is not None:
        return meta["ge"] - 1
    if meta.get("gt") is not None:
        return meta["gt"]
    if meta.get("le") is not None:
        return meta["le"] + 1
    if meta.get("lt") is not None:
        return meta["lt"]
    return None


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)
