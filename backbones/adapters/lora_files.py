"""LoRA files: the adapter of a fine-tuned transformer in diffusers' pipeline format, and loading it back.

`save_lora(model, folder)` writes, each file atomically:
- `pytorch_lora_weights.safetensors`: the LoRA tensors with `transformer.`-prefixed peft keys and the adapter's
  peft settings in the `lora_adapter_metadata` header entry, as diffusers' own training scripts write it. Flux, SD3
  and Wan: written by the pipeline's `save_lora_weights`, so `FluxPipeline.load_lora_weights(folder)` (and SD3's,
  and `WanPipeline`'s) loads it with no other argument. PixArt and DiT: the same format, though no diffusers pipeline or model of
  theirs loads a LoRA (diffusers 0.42 gives them no LoRA loader), so `load_lora` is the way back;
- `adapter_config.json`: our record, the LoRA settings and the model's class and config, which `load_lora` checks.

`load_lora(model, folder)` reads that layout and the one written before it (format tread-zoo-lora/1:
`adapter_model.safetensors` with unprefixed peft keys), so old run folders still load.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import load_file
from torch import nn

from backbones.adapters.lora import LoraSpec, add_lora, load_lora_state_dict, lora_state_dict
from backbones.adapters.pretrained import family_of, model_config
from routing import ConfigError

FORMAT = "tread-zoo-lora/2"
FORMAT_V1 = "tread-zoo-lora/1"  # adapter_model.safetensors with peft's keys, unprefixed
WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
WEIGHTS_V1 = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PREFIX = "transformer."  # the pipeline component the LoRA belongs to, as diffusers keys it
# The pipelines whose `load_lora_weights` reads the export; the other families have no LoRA loader in diffusers.
LORA_PIPELINES = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline", "wan": "WanPipeline"}


def adapter_metadata(model: nn.Module) -> dict:
    """peft's settings of the model's adapter as JSON values: what diffusers rebuilds the LoraConfig from."""
    config = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def save_lora(model: nn.Module, folder: str | os.PathLike, tensors: dict | None = None) -> Path:
    """Write the model's adapter in diffusers' pipeline format, plus adapter_config.json (see the module docstring).

    `tensors`: the LoRA tensors with peft's keys, when the model's own are not whole (gathered from FSDP shards)."""
    import diffusers
    from diffusers.loaders.lora_base import LoraBaseMixin

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = lora_state_dict(model) if tensors is None else tensors
    spec, family = model._tread_lora, family_of(model)
    meta = {
        "format": FORMAT,
        "weights": WEIGHTS,
        "lora": {**asdict(spec), "targets": list(spec.targets)},
        "model": {"class": type(model).__name__, "config": model_config(model)},
        "diffusers_pipeline": LORA_PIPELINES.get(family),
    }
    tmp = folder / f".tmp_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if family in LORA_PIPELINES:
            getattr(diffusers, LORA_PIPELINES[family]).save_lora_weights(
                tmp, transformer_lora_layers=tensors, transformer_lora_adapter_metadata=adapter_metadata(model))
        else:
            LoraBaseMixin.write_lora_layers(
                LoraBaseMixin.pack_weights(tensors, PREFIX[:-1]), str(tmp), is_main_process=True, weight_name=WEIGHTS,
                save_function=None, safe_serialization=True,
                lora_adapter_metadata=LoraBaseMixin.pack_weights(adapter_metadata(model), PREFIX[:-1]))
        (tmp / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        for name in (WEIGHTS, CONFIG):
            os.replace(tmp / name, folder / name)  # each file whole or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def read_lora_config(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise ConfigError(f"'{folder}' is not a LoRA adapter folder (it needs {CONFIG} and {WEIGHTS}, as save_lora writes).")
    meta = json.loads((folder / CONFIG).read_text())
    if meta.get("format") not in (FORMAT, FORMAT_V1):
        raise ConfigError(f"'{folder / CONFIG}' has format {meta.get('format')!r}, expected {FORMAT!r}.")
    weights = folder / (WEIGHTS if meta["format"] == FORMAT else WEIGHTS_V1)
    if not weights.is_file():
        raise ConfigError(f"'{folder}' lacks {weights.name}, which its {CONFIG} names; export the adapter again.")
    return meta


def read_lora_tensors(folder: str | os.PathLike) -> dict:
    """The LoRA tensors of an adapter folder with peft's keys (the `transformer.` prefix of the export removed)."""
    meta = read_lora_config(folder)
    if meta["format"] == FORMAT_V1:
        return load_file(Path(folder) / WEIGHTS_V1)
    tensors = load_file(Path(folder) / WEIGHTS)
    foreign = sorted(k for k in tensors if not k.startswith(PREFIX))
    if foreign:
        raise ConfigError(f"'{Path(folder) / WEIGHTS}' holds LoRA tensors of other components ({foreign[:2]}); "
                          "load_lora restores the transformer's only.")
    return {k[len(PREFIX):]: v for k, v in tensors.items()}


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
    load_lora_state_dict(model, read_lora_tensors(folder))
    return spec
