"""The `python -m train --help` text, generated from the schema: every key with its type, default, range and help."""

from __future__ import annotations

import dataclasses

from train.schema.check import _base_type, _fields
from train.schema.config import Config
from train.schema.data import DATA
from train.schema.keys import REFUSE, describe_range
from train.schema.objective import OBJECTIVES


def _fmt(value) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def _lines(cls: type, prefix: str = "") -> list[str]:
    out = []
    for name, f in _fields(cls).items():
        tp = _base_type(f.type)
        if dataclasses.is_dataclass(tp):
            out += ["", f"  {prefix}{name}: {f.metadata.get('help', '')}"] + _lines(tp, f"{prefix}{name}.")
            continue
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rng = describe_range(meta)
        extra = "; ".join(x for x in (rng, "fixed on resume" if meta.get("on_resume") == REFUSE else "") if x)
        out.append(f"    {prefix}{name}={_fmt(default)}  {meta.get('help', '')}{f' [{extra}]' if extra else ''}")
    return out


def help_template() -> str:
    lines = ["python -m train [group=option ...] [key=value ...]: train a diffusion model (docs/training.md).", "",
             "== Config groups (group=option) ==", "$APP_CONFIG_GROUPS", "(bench: python -m train.bench's, not the trainer's)",
             "", "== Keys (key=value; declared in train/schema/) =="]
    lines += _lines(Config)
    for section, options in (("data", DATA), ("objective", OBJECTIVES)):
        for option, cls in options.items():
            lines += ["", f"  {section}={option}: {(cls.__doc__ or '').strip().splitlines()[0] if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + '(') else ''}"]
            lines += _lines(cls, f"{section}.")
    lines += ["", "== Composed config (with your overrides) ==", "$CONFIG"]
    # The default run_dir holds `${now:...}`: escaped for OmegaConf (\\${) and then for Hydra's string.Template ($$).
    return "\n".join(lines).replace("${", "$\\${")
