"""A run's state files: a checkpoint's state.json and config.yaml, checkpoints/latest, and .hydra/overrides.yaml.

The trainer writes each of them atomically, so a kill never leaves one half-written; what these loaders refuse
was damaged or edited by hand, and each refusal names the file and what to do instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import yaml
from omegaconf import DictConfig, OmegaConf

from train.files.typed import MISSING, damaged, read_json, read_text, typed

STEP_FOLDER = re.compile(r"step_\d+")
OLDER = "use another checkpoint of the run (an older step_* folder), or restore this file"


@dataclass
class CheckpointState:
    """state.json: the optimizer step the checkpoint was written at, and a SHA-256 per file."""

    step: int = MISSING
    sha256: Dict[str, str] = field(default_factory=dict)  # checkpoints written before checksums have none
    pretrained: Optional[Dict[str, Any]] = None  # fine-tuning: the base model's config


def read_state(folder: Path) -> CheckpointState:
    path = folder / "state.json"
    state = typed(CheckpointState, read_json(path, OLDER), path, OLDER)
    if state.step < 0:
        raise damaged(path, f"field 'step' = {state.step} is negative", OLDER)
    return state


# The sections every saved config has; `backbone` only when training from scratch (fine-tuning saves `finetune`).
SECTIONS = ("data", "edm", "routing", "trainer")


def read_checkpoint_config(folder: Path) -> DictConfig:
    """config.yaml of a checkpoint: a YAML mapping holding the sections the network is rebuilt from."""
    path = folder / "config.yaml"
    try:
        cfg = OmegaConf.create(read_text(path, OLDER))  # OmegaConf's YAML loader, as OmegaConf.load
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise damaged(path, f"is not valid YAML ({getattr(err, 'problem', None) or type(err).__name__}{at})", OLDER) from None
    if not isinstance(cfg, DictConfig):
        raise damaged(path, "does not hold a config (a mapping of sections such as data, edm, trainer)", OLDER)
    wanted = [*SECTIONS, "backbone"] if not (cfg.get("finetune") or {}).get("family") else list(SECTIONS)
    missing = [name for name in wanted if not isinstance(cfg.get(name), DictConfig)]
    if missing:
        raise damaged(path, f"has no {', '.join(missing)} section", OLDER)
    return cfg


def read_overrides(path: Path) -> list[str]:
    """A run's .hydra/overrides.yaml: the command line's overrides it was started with, a YAML list of strings."""
    fix = "repeat the run's settings on the command line and restore or delete this file"
    try:
        overrides = yaml.safe_load(read_text(path, fix))
    except yaml.YAMLError:
        raise damaged(path, "is not valid YAML", fix) from None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise damaged(path, "is not a list of overrides (such as backbone=rwkv)", fix)
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 -- Hydra raises several types for a line it cannot parse
        raise damaged(path, "holds an override Hydra cannot parse", fix) from None
    return overrides


def read_latest(ckpt_root: Path) -> str | None:
    """The checkpoint folder name `checkpoints/latest` holds (None when there is no such file)."""
    path = ckpt_root / "latest"
    if not path.exists():
        return None
    fix = "write the name of one of its step_* folders into it (e.g. step_0000100), or delete it to use the newest"
    name = read_text(path, fix).strip()
    if not STEP_FOLDER.fullmatch(name):
        raise damaged(path, "is empty" if not name else f"names {name[:40]!r}, not a checkpoint folder", fix)
    return name
