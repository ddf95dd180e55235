"""Checkpoints: a folder per step with safetensors weights, optimizer state, step and config; and
`load_run`, which turns a run or checkpoint folder back into a ready EMA network.

Each checkpoint is written into a temporary folder and renamed into place, and `latest` is replaced
atomically, so a run killed mid-write never leaves a half checkpoint behind the pointer.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

from routing import ConfigError
from train.build import build_net, objective_for
from train.data import build_dataset

# Sections that fix the shape of the network; changing them makes a checkpoint unloadable.
MODEL_KEYS = ("backbone", "data", "objective")
# What a config written before a section existed meant by it.
_ABSENT = {"objective": {"name": "edm"}}


def save_checkpoint(ckpt_root: Path, step: int, model, ema_model, optimizer, cfg: DictConfig, keep: int = 2) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:07d}"
    tmp = ckpt_root / f".tmp_step_{step:07d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_contiguous(model.state_dict()), tmp / "model.safetensors")
    save_file(_contiguous(ema_model.state_dict()), tmp / "ema.safetensors")
    torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    (tmp / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(ckpt_root / "latest", final.name)
    for old in sorted(ckpt_root.glob("step_*"))[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    pointer = ckpt_root / "latest"
    if not pointer.exists():
        return None
    path = ckpt_root / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(path: Path, cfg: DictConfig | None = None) -> dict:
    """Read a checkpoint folder; with `cfg`, refuse one whose model-defining config differs."""
    path = Path(path)
    needed = ("model.safetensors", "ema.safetensors", "optimizer.pt", "state.json", "config.yaml")
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise ConfigError(f"checkpoint '{path}' is missing {missing}; point resume= at a folder written by this trainer (e.g. runs/X/checkpoints/step_0000100).")
    saved_cfg = OmegaConf.load(path / "config.yaml")
    if cfg is not None:
        for key in MODEL_KEYS:
            mine, theirs = (OmegaConf.to_container(c[key], resolve=True) if key in c else _ABSENT[key] for c in (cfg, saved_cfg))
            if mine != theirs:
                diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                raise ConfigError(
                    f"checkpoint '{path}' was trained with a different {key} config (differs in {', '.join(f'{key}.{k}' for k in diff)}: "
                    f"{ {k: theirs.get(k) for k in diff} }); resume with the same {key} settings or use a new run_dir."
                )
    try:
        model, ema = load_file(path / "model.safetensors"), load_file(path / "ema.safetensors")
        extra = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    except Exception as err:  # safetensors and pickle raise many types for a damaged file
        raise ConfigError(f"checkpoint '{path}' is unreadable ({type(err).__name__}: {err}); resume from an older step_* folder.") from err
    state = json.loads((path / "state.json").read_text())
    return {"model": model, "ema": ema, "config": saved_cfg, "step": state["step"], **extra}


def _contiguous(state: dict) -> dict:
    # safetensors refuses shared or strided storage; clone makes each tensor its own.
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class Loaded:
    net: torch.nn.Module  # the objective's network with EMA weights, eval mode: net(x, t, class_labels)
    objective: object  # edm.EDM or edm.Flow, as trained
    cfg: DictConfig
    dataset: object
    checkpoint: Path
    step: int


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (its latest checkpoint)."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path
    latest = latest_checkpoint(path / "checkpoints")
    if latest is None:
        raise ConfigError(f"'{path}' is neither a checkpoint folder nor a run folder with checkpoints/latest; pass runs/X or runs/X/checkpoints/step_N.")
    return latest


def load_run(checkpoint: str | Path, device: str | torch.device = "cpu") -> Loaded:
    """The EMA network of a run folder (its latest checkpoint) or a checkpoint folder, in eval mode on `device`."""
    path = resolve_checkpoint(checkpoint)
    state = load_checkpoint(path)
    cfg = state["config"]
    dataset = build_dataset(cfg.data, cfg.edm.sigma_data)
    net = build_net(cfg, dataset)
    net.load_state_dict(state["ema"])
    return Loaded(net.to(device).eval(), objective_for(cfg), cfg, dataset, path, state["step"])
