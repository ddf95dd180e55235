"""Checkpoints: a folder per step with safetensors weights, optimizer state, step and config; and
`load_run`, which turns a run or checkpoint folder back into a ready EMA network.

Each checkpoint is written into a temporary folder and renamed into place, and `latest` is replaced
atomically, so a run killed mid-write never leaves a half checkpoint behind the pointer.

A fine-tuning checkpoint holds the trained tensors only: the LoRA tensors with peft's keys (or, with
finetune.train=full, every weight with diffusers' keys), plus `lora/`, the EMA adapter as `save_lora` writes it:
diffusers' pipeline format, which `FluxPipeline.load_lora_weights(lora/)` (and SD3's and Wan's) loads, and peft and
load_lora too; `lora_raw/` is the raw (not averaged) adapter in the same format. The base weights stay in finetune.pretrained, whose config
state.json records, so a changed base model is refused instead of silently mixed with the adapter.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from safetensors.torch import save_file

from backbones.adapters import load_lora_state_dict, lora_state_dict, model_config, save_lora
from routing import ConfigError
from train.build import build_net, check_base, finetune_family, objective_for, pretrained_of
from train.data import build_dataset
from train.distributed import copy_into_shards, is_sharded
from train.files import as_os_error, damaged, read_checkpoint_config, read_latest, read_state, read_tensors, write_atomic
from train.schema import resolved_backbone

# Sections that fix the shape of the network; changing them makes a checkpoint unloadable.
MODEL_KEYS = ("backbone", "data", "objective")
# What a config written before a section existed meant by it.
_ABSENT = {"objective": {"name": "edm"}}
TMP_PREFIX = ".tmp_"
REPLACED_PREFIX = ".replaced_"


class NonFiniteWeights(ValueError):
    """A state dict holds NaN or inf; it is never written."""


def non_finite(state: dict) -> list[str]:
    """Names of the tensors of `state` (nested dicts and lists too) that hold NaN or inf."""
    bad = []

    def visit(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                bad.append(prefix)
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{prefix}[{i}]", v)

    visit("", state)
    return bad


def trained_state(net, cfg: DictConfig) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint keeps of `net`: its whole state dict when trained from scratch; when fine-tuning,
    the trained tensors only (LoRA with peft's keys, or with finetune.train=full every weight with diffusers' keys)."""
    if not finetune_family(cfg):
        return net.state_dict()
    model = pretrained_of(net)
    return lora_state_dict(model) if cfg.finetune.train == "lora" else model.state_dict()


def trained_views(net, cfg: DictConfig) -> dict[str, torch.Tensor]:
    """trained_state's tensors, uncopied: they share storage with the parameters (their shards, under FSDP), so a
    checkpoint can be copied into them, and gathered from them."""
    if not finetune_family(cfg):
        return net.state_dict()
    model = pretrained_of(net)
    if cfg.finetune.train != "lora":
        return model.state_dict()
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)  # lora_state_dict's keys, before its copies


def _load_sharded(net, cfg: DictConfig, tensors: dict) -> bool:
    """Copy a checkpoint's full tensors into an FSDP-sharded `net`; False (nothing done) when `net` is not sharded."""
    views = trained_views(net, cfg)
    if not is_sharded(views.values()):
        return False
    copy_into_shards(views, tensors)
    return True


def load_trained_state(net, state: dict, which: str, cfg: DictConfig) -> None:
    """Put a checkpoint's `which` tensors ("model" or "ema") into `net`, built from `cfg` as the run was.

    Fine-tuning: the base comes from finetune.pretrained, so a base whose config differs from the one the
    checkpoint was trained on is refused.
    """
    tensors = state[which]
    if not finetune_family(cfg):
        if not _load_sharded(net, cfg, tensors):
            net.load_state_dict(tensors)
        return
    model = pretrained_of(net)
    check_base(model, (state["path"], state.get("pretrained")), cfg.finetune.pretrained)  # build_net checked it too, if told
    if _load_sharded(net, cfg, tensors):
        return
    if cfg.finetune.train == "lora":
        load_lora_state_dict(model, tensors)
    else:
        model.load_state_dict(tensors)


def save_checkpoint(ckpt_root: Path, step: int, model, ema_model, optimizer, cfg: DictConfig, keep: int = 2,
                    gathered: dict | None = None, align: dict | None = None) -> Path:
    """Write checkpoint `step` so that the folder always holds a loadable one that `latest` names.

    New files go to a temporary folder first. Re-saving an existing step moves the old folder aside to
    `.replaced_step_N` (one rename) before the new one is renamed in; a kill between the two renames is
    undone by `recover_checkpoints` at the next start (and `latest_checkpoint` finds the moved-aside copy
    meanwhile). Rotation keeps the `keep` newest and never deletes the one `latest` names.

    `gathered`: the full "model", "ema" and "optimizer" (keyed by parameter name) states of an FSDP-sharded run, which
    the processes gathered together (the modules hold shards only). `align`: the alignment projector's state
    (align=repa|self), saved as align.safetensors beside the model, never in it (exports and load_run do not read it).
    """
    if gathered is None:
        model_state, ema_state = _contiguous(trained_state(model, cfg)), _contiguous(trained_state(ema_model, cfg))
        optimizer_state, extra = optimizer.state_dict(), {}
    else:
        model_state, ema_state, optimizer_state = gathered["model"], gathered["ema"], gathered["optimizer"]
        extra = {"optimizer_keys": "names"}
    align_state = _contiguous(align) if align is not None else None
    bad = non_finite(model_state) + non_finite(ema_state) + non_finite(align_state or {})
    if bad:
        raise NonFiniteWeights(f"{len(bad)} tensors hold NaN or inf (e.g. {bad[0]!r})")
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:07d}"
    tmp = ckpt_root / f"{TMP_PREFIX}{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file(model_state, tmp / "model.safetensors")
        save_file(ema_state, tmp / "ema.safetensors")
        torch.save({"optimizer": optimizer_state, "torch_rng": torch.get_rng_state(), **extra}, tmp / "optimizer.pt")
        if align_state is not None:
            save_file(align_state, tmp / "align.safetensors")
        written = ("model.safetensors", "ema.safetensors", "optimizer.pt") + (("align.safetensors",) if align_state is not None else ())
        digests = {name: _sha256(tmp / name) for name in written}
        state = {"step": step, "sha256": digests}
        if finetune_family(cfg):
            state["pretrained"] = model_config(pretrained_of(model))
            if cfg.finetune.train == "lora":
                # The EMA adapter, for diffusers' pipelines and load_lora (under FSDP: its gathered tensors).
                save_lora(pretrained_of(ema_model), tmp / "lora", tensors=None if gathered is None else ema_state)
                # The raw adapter (the last step's, not averaged) in the same format: model.safetensors holds it with
                # peft's keys for resuming, which diffusers' loaders do not read.
                save_lora(pretrained_of(model), tmp / "lora_raw", tensors=None if gathered is None else model_state)
        (tmp / "state.json").write_text(json.dumps(state))
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    except BaseException as err:
        # torch.save and safetensors report a full disk with their own types (classified before the cleanup frees space).
        failure = as_os_error(err, tmp / "x") if isinstance(err, Exception) and not isinstance(err, OSError) else None
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk leaves no half-written folder behind
        if failure is not None:
            raise failure from err
        raise
    if final.exists():
        aside = ckpt_root / f"{REPLACED_PREFIX}{final.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        write_atomic(ckpt_root / "latest", final.name)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, final)
        write_atomic(ckpt_root / "latest", final.name)
    rotate_checkpoints(ckpt_root, keep, protect=final)
    return final


def rotate_checkpoints(ckpt_root: Path, keep: int, protect: Path) -> None:
    """Delete all but the `keep` newest step_* folders; `protect` (the one `latest` names) always stays."""
    others = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and p.name != protect.name)
    for old in others[: max(0, len(others) - (max(keep, 1) - 1))]:
        shutil.rmtree(old)


def recover_checkpoints(ckpt_root: Path) -> list[str]:
    """Undo what a killed save left behind; returns what it did (for the log).

    A `.replaced_step_N` whose step_N is missing is moved back (the kill came between the two renames);
    temporary folders and pointer files are removed; a `latest` naming a missing folder is pointed at the
    newest complete checkpoint.
    """
    done = []
    if not ckpt_root.is_dir():
        return done
    for aside in sorted(ckpt_root.glob(f"{REPLACED_PREFIX}step_*")):
        final = ckpt_root / aside.name[len(REPLACED_PREFIX):]
        if final.is_dir():
            shutil.rmtree(aside)
            done.append(f"removed {aside.name}")
        else:
            os.replace(aside, final)
            done.append(f"restored {final.name} from {aside.name}")
    for tmp in [*ckpt_root.glob(f"{TMP_PREFIX}*"), *ckpt_root.glob(".latest.*")]:
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        done.append(f"removed {tmp.name}")
    target = read_latest(ckpt_root)
    newest = sorted(p.name for p in ckpt_root.glob("step_*") if p.is_dir())
    if newest and (target is None or not (ckpt_root / target).is_dir()):
        write_atomic(ckpt_root / "latest", newest[-1])
        done.append(f"pointed latest at {newest[-1]}")
    return done


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint `latest` names; if a killed save left it dangling (or it is gone), the moved-aside copy or the
    newest step_*. A `latest` edited into something that is no checkpoint name is refused (files/run_state.py)."""
    name = read_latest(ckpt_root) if ckpt_root.is_dir() else None
    if name is not None:
        for path in (ckpt_root / name, ckpt_root / f"{REPLACED_PREFIX}{name}"):
            if path.is_dir():
                return path
    newest = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    return newest[-1] if newest else None


def load_checkpoint(path: Path, cfg: DictConfig | None = None) -> dict:
    """Read a checkpoint folder; with `cfg`, refuse one whose model-defining config differs."""
    path = Path(path)
    needed = ("model.safetensors", "ema.safetensors", "optimizer.pt", "state.json", "config.yaml")
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise ConfigError(f"checkpoint '{path}' is missing {missing}; point resume= at a folder written by this trainer (e.g. runs/X/checkpoints/step_0000100).")
    saved_cfg = read_checkpoint_config(path)
    state = read_state(path)
    if cfg is not None:
        for key in MODEL_KEYS:
            mine, theirs = (_model_section(c, key) for c in (cfg, saved_cfg))
            if mine != theirs:
                diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                changes = "; ".join(f"{key}.{k}: {theirs.get(k)!r} -> {mine.get(k)!r}" for k in diff)  # trained -> now
                raise ConfigError(f"checkpoint '{path}' was trained with a different {key} config (differs in {changes}); resume "
                                  f"with the same {key} settings or use a new run_dir.")
    # Each safetensors file through the typed loader: one cut short or emptied is named, with the way out.
    older = "resume from an older step_* folder"
    model, ema = read_tensors(path / "model.safetensors", older), read_tensors(path / "ema.safetensors", older)
    align = read_tensors(path / "align.safetensors", older) if (path / "align.safetensors").is_file() else None  # align=repa|self
    extra = _read_optimizer(path / "optimizer.pt", older)
    if align is not None:
        extra["align"] = align
    for name, digest in state.sha256.items():
        if _sha256(path / name) != digest:
            raise ConfigError(f"checkpoint '{path}' is corrupted ({name} does not match the checksum written with it); "
                              "resume from an older step_* folder.")
    for name, tensors in (("model.safetensors", model), ("ema.safetensors", ema), ("optimizer.pt", extra.get("optimizer", {})),
                          ("align.safetensors", extra.get("align", {}))):
        bad = non_finite(tensors)
        if bad:
            raise ConfigError(f"checkpoint '{path}' holds NaN or inf in {name} ({len(bad)} tensors, e.g. {bad[0]!r}); "
                              "resume from an older step_* folder.")
    return {"model": model, "ema": ema, "config": saved_cfg, "step": state.step, "pretrained": state.pretrained,
            "path": path, **extra}


def _read_optimizer(path: Path, fix: str) -> dict:
    """optimizer.pt: AdamW's state and the torch RNG, as save_checkpoint wrote them; damage named in one sentence, as the
    safetensors files' is."""
    try:
        extra = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 -- pickle raises many types for a damaged file
        first = (str(err).strip().splitlines() or ["damaged"])[0].split(". ")[0][:120].rstrip(".")
        raise damaged(path, f"is not a readable PyTorch file ({type(err).__name__}: {first})", fix) from None
    missing = [k for k in ("optimizer", "torch_rng") if not isinstance(extra, dict) or k not in extra]
    if missing:
        raise damaged(path, f"holds no {' and no '.join(missing)} state (it is not an optimizer.pt this trainer wrote)", fix)
    return extra


def _model_section(cfg: DictConfig, key: str) -> dict:
    """A model-defining section as the model is built from it (the backbone's null sizes as its preset's)."""
    section = OmegaConf.to_container(cfg[key], resolve=True) if key in cfg else _ABSENT[key]
    return resolved_backbone(section) if key == "backbone" else section


def _contiguous(state: dict) -> dict:
    # safetensors refuses shared or strided storage; clone makes each tensor its own.
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
        raise ConfigError(f"'{path}' {_no_checkpoint(path)}.")
    return latest


# What a trainer writes into its run folder before the first checkpoint: a folder holding one is a run, not a typo.
_RUN_MARKS = (".hydra", "metrics.jsonl", "config.yaml", "train.log", "checkpoints")


def _no_checkpoint(path: Path) -> str:
    """Why `path` gives no checkpoint to load, and what to do: a typo, a run with none yet, or a dangling `latest`."""
    if not path.exists():
        return "does not exist; pass runs/X or runs/X/checkpoints/step_N"
    if not any((path / mark).exists() for mark in _RUN_MARKS):
        return ("is neither a checkpoint folder nor a run folder with checkpoints/latest; pass runs/X or "
                "runs/X/checkpoints/step_N")
    named = read_latest(path / "checkpoints") if (path / "checkpoints").is_dir() else None
    if named is not None:  # latest_checkpoint found neither it, its moved-aside copy, nor any other step_* folder
        return (f"is a run folder whose checkpoints/latest names {named}, which is missing, and no other step_* folder "
                f"is there; restore {named} into its checkpoints/ folder, or pass a checkpoint folder of another run")
    return ("is a run folder with no checkpoint yet; wait for its first one (the trainer writes one every "
            "trainer.ckpt_every steps and at the end), or, for a run trained with trainer.ckpt_every=0 (no "
            "checkpoints), train it again with trainer.ckpt_every=N")


def load_run(checkpoint: str | Path, device: str | torch.device = "cpu", pretrained: str | None = None) -> Loaded:
    """The EMA network of a run folder (its latest checkpoint) or a checkpoint folder, in eval mode on `device`.

    pretrained: where a fine-tuning run's base model lives now, if it moved since (default: the run's
    finetune.pretrained); its config is still checked against the one the checkpoint records."""
    path = resolve_checkpoint(checkpoint)
    state = load_checkpoint(path)
    cfg = state["config"]
    if finetune_family(cfg):
        if pretrained is not None:
            cfg.finetune.pretrained = str(Path(pretrained).expanduser())
        elif not Path(str(cfg.finetune.pretrained)).expanduser().exists():
            raise ConfigError(f"checkpoint '{path}' was fine-tuned from finetune.pretrained='{cfg.finetune.pretrained}', "
                              "which is not there any more; pass --pretrained PATH where the base model lives now, or put "
                              "it back.")
    elif pretrained is not None:
        raise ConfigError(f"--pretrained is for fine-tuning runs; checkpoint '{path}' trained its model from scratch, so "
                          "drop the flag.")
    try:
        dataset = build_dataset(cfg.data, cfg.edm.sigma_data)
        net = build_net(cfg, dataset, trained_from=(path, state["pretrained"]))  # a changed base named before the data
        load_trained_state(net, state, "ema", cfg)
    except (OmegaConfBaseException, KeyError, TypeError, RuntimeError) as err:  # a config.yaml or weights edited by hand
        where = f" at {err.full_key}" if getattr(err, "full_key", None) else ""
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"checkpoint '{path}' cannot be rebuilt from its config.yaml and weights ({type(err).__name__}{where}: "
                          f"{first.rstrip('.')}); use another checkpoint of the run (an older step_* folder).") from None
    return Loaded(net.to(device).eval(), objective_for(cfg), cfg, dataset, path, state["step"])
