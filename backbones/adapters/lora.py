"""Pretrained loading from a local folder, and LoRA (peft) on the attention projections with adapter-only files.

- `load_pretrained(family, path)`: a diffusers transformer from a local folder, never from the network; a
  missing folder is a ConfigError naming what to fetch.
- `add_lora(model, rank=...)`: freezes every base weight and adds LoRA to the attention projections present
  (to_q, to_k, to_v, to_out.0 and, for joint attention, add_q/k/v_proj and to_add_out).
- `save_lora(model, folder)` / `load_lora(model, folder)`: only the LoRA tensors (safetensors) plus a small
  JSON (LoRA settings, the model's class and config); loading checks both and restores the tensors exactly.
- `lora_state_dict` / `load_lora_state_dict`: the same tensors in memory, for a trainer's own checkpoints.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from routing import ConfigError

FORMAT = "tread-zoo-lora/1"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"

# Attention projections LoRA adapts by default; only those the model has are targeted.
ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

# What to fetch for each family: the diffusers class and a public checkpoint of it (for the error message).
PRETRAINED = {
    "flux": ("FluxTransformer2DModel", "black-forest-labs/FLUX.1-dev"),
    "sd3": ("SD3Transformer2DModel", "stabilityai/stable-diffusion-3.5-medium"),
    "pixart": ("PixArtTransformer2DModel", "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"),
    "dit": ("DiTTransformer2DModel", "facebook/DiT-XL-2-256"),
}


def model_class(family: str):
    if family not in PRETRAINED:
        raise ConfigError(f"pretrained family '{family}' is unknown; choose one of {sorted(PRETRAINED)}.")
    import diffusers

    return getattr(diffusers, PRETRAINED[family][0])


def pretrained_folder(family: str, path: str | os.PathLike, what: str = "pretrained path") -> Path:
    """The folder holding the family's diffusers transformer: `path` itself or its transformer/ (a pipeline folder).

    Reads only config.json, so a config check can refuse a missing model before any work starts.
    """
    if family not in PRETRAINED:
        raise ConfigError(f"pretrained family '{family}' is unknown; choose one of {sorted(PRETRAINED)}.")
    name, repo = PRETRAINED[family]
    root = Path(path).expanduser()
    folder = next((d for d in (root, root / "transformer") if (d / "config.json").is_file()), None)
    if folder is None:
        raise ConfigError(
            f"{what} '{root}' holds no diffusers {name} (config.json there or in transformer/); "
            f"fetch one first, e.g. `huggingface-cli download {repo} --include 'transformer/*' --local-dir {root}`."
        )
    found = json.loads((folder / "config.json").read_text()).get("_class_name")
    if found not in (None, name):
        raise ConfigError(f"{what} '{folder}' holds a {found}, not the {name} that family '{family}' needs.")
    return folder


def load_pretrained(family: str, path: str | os.PathLike, torch_dtype: torch.dtype | None = None) -> nn.Module:
    """The family's diffusers transformer from `path` (its folder, or a pipeline folder with transformer/)."""
    folder = pretrained_folder(family, path)
    return model_class(family).from_pretrained(folder, torch_dtype=torch_dtype, local_files_only=True)


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    alpha: float | None = None  # None: alpha = rank (scale 1)
    dropout: float = 0.0
    targets: tuple[str, ...] = ATTENTION_PROJECTIONS


def present_targets(model: nn.Module, targets) -> list[str]:
    names = [name for name, _ in model.named_modules()]
    return [t for t in targets if any(n == t or n.endswith("." + t) for n in names)]


def add_lora(model: nn.Module, rank: int = 16, alpha: float | None = None, dropout: float = 0.0,
             targets=ATTENTION_PROJECTIONS) -> LoraSpec:
    """Freeze the model and add LoRA (B = 0, so the output is unchanged) to the attention projections present."""
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ConfigError(f"lora.rank={rank} must be a positive integer.")
    found = present_targets(model, targets)
    if not found:
        raise ConfigError(f"lora.targets={list(targets)} match no module of this {type(model).__name__}.")
    spec = LoraSpec(rank, alpha, dropout, tuple(found))
    model.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, lora_dropout=dropout,
                        target_modules=found, init_lora_weights=True)
    inject_adapter_in_model(config, model)
    for p in lora_parameters(model):
        # peft creates the adapters in the base's dtype; a bf16 base still trains fp32 LoRA weights, whose
        # small updates bf16 would round away.
        p.data = p.data.float()
        p.requires_grad_(True)
    model._tread_lora = spec
    return spec


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if ".lora_" in name]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA tensors, keyed by module path without the adapter name (peft's format)."""
    from peft import get_peft_model_state_dict

    if not hasattr(model, "_tread_lora"):
        raise ConfigError(f"this {type(model).__name__} has no LoRA; call add_lora(model, ...) first.")
    return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_lora_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy LoRA tensors into the model's LoRA layers; every key must match, both ways."""
    from peft import set_peft_model_state_dict

    expected = set(lora_state_dict(model))
    if set(tensors) != expected:
        missing, unknown = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ConfigError(f"LoRA tensors do not match this model's adapters (missing {missing[:3]}, unknown {unknown[:3]}).")
    result = set_peft_model_state_dict(model, tensors)
    if getattr(result, "unexpected_keys", None):
        raise ConfigError(f"peft did not place LoRA tensors {result.unexpected_keys[:3]}.")


def model_config(model: nn.Module) -> dict:
    """The diffusers config that fixes the model's shape, as plain JSON values."""
    # Private diffusers keys (_class_name, _diffusers_version, _name_or_path, ...) describe provenance, not shape.
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    return json.loads(json.dumps(config, default=list))


def save_lora(model: nn.Module, folder: str | os.PathLike) -> Path:
    """Write the adapter only: adapter_model.safetensors + adapter_config.json, each atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, spec = lora_state_dict(model), model._tread_lora
    meta = {
        "format": FORMAT,
        "lora": {**asdict(spec), "targets": list(spec.targets)},
        "model": {"class": type(model).__name__, "config": model_config(model)},
    }
    # diffusers' `model.load_lora_adapter(folder, prefix=None, weight_name=WEIGHTS)` reads the LoRA settings
    # (alpha above all, which the tensors do not reveal) from this metadata entry.
    peft = {"r": spec.rank, "lora_alpha": spec.alpha if spec.alpha is not None else spec.rank,
            "lora_dropout": spec.dropout, "target_modules": list(spec.targets)}
    metadata = {"format": FORMAT, "lora_adapter_metadata": json.dumps(peft)}
    _atomic(folder / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    _atomic(folder / CONFIG, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))
    return folder


def read_lora_config(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ConfigError(f"'{folder}' is not a LoRA adapter folder (it needs {CONFIG} and {WEIGHTS}, as save_lora writes).")
    meta = json.loads((folder / CONFIG).read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"'{folder / CONFIG}' has format {meta.get('format')!r}, expected {FORMAT!r}.")
    return meta


def load_lora(model: nn.Module, folder: str | os.PathLike) -> LoraSpec:
    """Add (if needed) and fill the LoRA of `folder` on `model`, which must be the class and config it was trained on."""
    meta = read_lora_config(folder)
    cls, config = meta["model"]["class"], meta["model"]["config"]
    if cls != type(model).__name__:
        raise ConfigError(f"the LoRA in '{folder}' was trained on a {cls}, not a {type(model).__name__}.")
    differ = sorted(k for k in set(config) | set(model_config(model)) if config.get(k) != model_config(model).get(k))
    if differ:
        raise ConfigError(f"the LoRA in '{folder}' was trained on a {cls} whose config differs in {differ}; load that model.")
    lora = meta["lora"]
    spec = LoraSpec(lora["rank"], lora["alpha"], lora["dropout"], tuple(lora["targets"]))
    if not hasattr(model, "_tread_lora"):
        add_lora(model, spec.rank, spec.alpha, spec.dropout, spec.targets)
    elif model._tread_lora != spec:
        raise ConfigError(f"the model already has LoRA {model._tread_lora}, but '{folder}' holds {spec}.")
    load_lora_state_dict(model, load_file(Path(folder) / WEIGHTS))
    return spec


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
