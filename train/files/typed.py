"""Reading a file the project relies on: text, JSON and typed fields, each fault as one sentence naming the file.

`typed` checks a JSON object against a dataclass with OmegaConf's structured configs (the library the config
schema uses): a missing field, a value of the wrong type or a list where an object belongs is refused with the
field's name. Fields the dataclass does not declare are ignored, so a file written by a newer version still reads.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

# The one sentence of a refused file, and the readers of text, JSON and safetensors, are the model packages' too
# (backbones/files.py); re-exported here for the loaders of this package.
from backbones.files import damaged, read_config, read_head, read_json, read_tensors, read_text, safetensors_metadata, tensor_shapes

__all__ = ["MISSING", "damaged", "finite", "read_config", "read_head", "read_json", "read_tensors", "read_text", "safetensors_metadata",
           "tensor_shapes", "typed"]


_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list", dict: "an object"}
_PLURAL = {int: "integers", float: "numbers", str: "strings"}


def _container(tp: Any) -> type | None:
    """list for List[...] / Optional[List[...]], dict for Dict[...], else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
    origin = typing.get_origin(args[0]) if len(args) == 1 else None
    return origin if origin in (list, dict) else None


def typed(schema: type, value: Any, path: str | os.PathLike, fix: str, where: str = ""):
    """`value` as an instance of dataclass `schema`, or a refusal naming the field (`where` prefixes nested names)."""
    names = [f.name for f in dataclasses.fields(schema)]
    if not isinstance(value, dict):
        what = f"field '{where.rstrip('.')}'" if where else "its content"
        raise damaged(path, f"{what} is {_KIND.get(type(value), type(value).__name__)}, not an object with the fields "
                            f"{', '.join(names)}", fix)
    hints = typing.get_type_hints(schema)
    known = {name: value[name] for name in names if name in value}
    for name, item in known.items():
        kind = _container(hints[name])
        if kind is not None and item is not None and not isinstance(item, kind):
            raise damaged(path, f"field '{where}{name}' is {_KIND.get(type(item), type(item).__name__)}, not {_KIND[kind]}", fix)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), known))
    except MissingMandatoryValue as err:
        raise damaged(path, f"has no field '{where}{err.full_key}'", fix) from None
    except OmegaConfBaseException as err:
        key = f"{where}{err.full_key}" if err.full_key else where.rstrip(".") or "?"
        found = getattr(err, "value", None)
        name = str(err.full_key).split("[")[0]
        expected = _expected(hints.get(name), item="[" in str(err.full_key))
        raise damaged(path, f"field '{key}' = {found!r} is not {expected}", fix) from None


def _expected(tp: Any, item: bool = False) -> str:
    """'an integer', 'a list of numbers', ... for a field's type hint (`item`: for one item of a list field)."""
    if tp is None:
        return "of the expected type"
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
    base = args[0] if len(args) == 1 else tp
    if typing.get_origin(base) is list:
        inner = typing.get_args(base)[0]
        return _KIND.get(inner, "of the expected type") if item else "a list of " + _PLURAL.get(inner, "values")
    return _KIND.get(typing.get_origin(base) or base, "of the expected type")


def finite(values: Any) -> bool:
    """True when every number in `values` (a number or a list of them) is finite."""
    items = values if isinstance(values, (list, tuple)) else [values]
    return all(math.isfinite(v) for v in items)
