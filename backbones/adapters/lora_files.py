"""LoRA files: the adapter of a fine-tuned transformer in a folder that diffusers, peft and tread-zoo all read.

`save_lora(model, folder)` writes, each file atomically:
- `pytorch_lora_weights.safetensors`: the LoRA tensors with `transformer.`-prefixed peft keys and the adapter's
  peft settings in the `lora_adapter_metadata` header entry, as diffusers' own training scripts write it. Flux, SD3
  and Wan: written by the pipeline's `save_lora_weights`, so `FluxPipeline.load_lora_weights(folder)` (and SD3's,
  and `WanPipeline`'s) loads it with no other argument, and so does the transformer's own
  `load_lora_adapter(folder, prefix="transformer")`. PixArt and DiT: the same format, though no diffusers pipeline or
  model of theirs loads a LoRA (diffusers 0.42 gives them no LoRA loader), so `load_lora` is the way back;
- `adapter_model.safetensors` and `adapter_config.json`: the same tensors as peft's `save_pretrained` writes them
  (keys under `base_model.model.`, peft's LoraConfig schema), so `peft.PeftModel.from_pretrained(model, folder)` loads
  the adapter onto the base model, for every family;
- `tread_zoo_lora.json`: our record, the LoRA settings and the model's class and config, which `load_lora` checks.

`load_lora(model, folder)` reads that layout and the two written before it, whose record was `adapter_config.json`
itself: format tread-zoo-lora/2 (the diffusers file alone) and tread-zoo-lora/1 (`adapter_model.safetensors` with
unprefixed peft keys), so old run folders still load. Every file of the folder it finds, peft's pair included, is read
through backbones/files.py before the model is touched: one cut short, emptied or edited into something else is one
FileError sentence naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from backbones.adapters.lora import LoraSpec, add_lora, load_lora_state_dict, lora_state_dict
from backbones.adapters.pretrained import family_of, model_config
from backbones.files import damaged, read_json, read_tensors, tensor_shapes
from routing import ConfigError

FORMAT = "tread-zoo-lora/3"
FORMAT_V2 = "tread-zoo-lora/2"  # the diffusers file, with our record under adapter_config.json
FORMAT_V1 = "tread-zoo-lora/1"  # adapter_model.safetensors with peft's keys, unprefixed
WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
PEFT_WEIGHTS = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME (format 1 used the name too)
PEFT_CONFIG = "adapter_config.json"  # peft's CONFIG_NAME (formats 1 and 2 kept our record there)
RECORD = "tread_zoo_lora.json"
WEIGHTS_OF = {FORMAT: WEIGHTS, FORMAT_V2: WEIGHTS, FORMAT_V1: PEFT_WEIGHTS}  # the file load_lora reads, per format
PREFIX = "transformer."  # the pipeline component the LoRA belongs to, as diffusers keys it
PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the model it wraps, as peft keys its saved tensors
FIX = "export the adapter again with save_lora (a training checkpoint holds it in lora/, the raw one in lora_raw/)"
# The pipelines whose `load_lora_weights` reads the export; the other families have no LoRA loader in diffusers.
LORA_PIPELINES = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline", "wan": "WanPipeline"}


def adapter_metadata(model: nn.Module) -> dict:
    """peft's settings of the model's adapter as JSON values: what diffusers rebuilds the LoraConfig from."""
    config = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def save_lora(model: nn.Module, folder: str | os.PathLike, tensors: dict | None = None) -> Path:
    """Write the model's adapter for diffusers, peft and load_lora (see the module docstring).

    `tensors`: the LoRA tensors with peft's keys, when the model's own are not whole (gathered from FSDP shards)."""
    import diffusers
    from diffusers.loaders.lora_base import LoraBaseMixin

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = lora_state_dict(model) if tensors is None else tensors
    spec, family = model._tread_lora, family_of(model)
    record = {
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
        # peft's own pair, as PeftModel.save_pretrained writes it (its config's save_pretrained adds peft_type and
        # the peft version).
        save_file({PEFT_PREFIX + k: v for k, v in tensors.items()}, tmp / PEFT_WEIGHTS, metadata={"format": "pt"})
        model.peft_config["default"].save_pretrained(str(tmp))
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        for name in (WEIGHTS, PEFT_WEIGHTS, PEFT_CONFIG, RECORD):  # the record last: it marks the folder complete
            os.replace(tmp / name, folder / name)  # each file whole or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def read_lora_config(folder: str | os.PathLike) -> dict:
    """Our record of an adapter folder: tread_zoo_lora.json, or adapter_config.json in the formats before it; a record
    cut short or edited into something else is refused (FileError), naming the file."""
    folder = Path(folder)
    if (folder / RECORD).exists():
        path = folder / RECORD
        meta = read_json(path, FIX)
    elif (folder / PEFT_CONFIG).is_file() and isinstance(old := read_json(folder / PEFT_CONFIG, FIX), dict) and "format" in old:
        path, meta = folder / PEFT_CONFIG, old
    else:
        raise ConfigError(f"'{folder}' is not a LoRA adapter folder (it needs {RECORD} and {WEIGHTS}, as save_lora writes).")
    if not isinstance(meta, dict):
        raise damaged(path, "is not a JSON object (the adapter's record)", FIX)
    if meta.get("format") not in (FORMAT, FORMAT_V2, FORMAT_V1):
        raise ConfigError(f"'{folder}' records format {meta.get('format')!r}, expected {FORMAT!r}.")
    fault = _record_fault(meta)
    if fault:
        raise damaged(path, fault, FIX)
    weights = folder / WEIGHTS_OF[meta["format"]]
    if not weights.is_file():
        raise ConfigError(f"'{folder}' lacks {weights.name}, which its record names; export the adapter again.")
    return meta


def _record_fault(meta: dict) -> str | None:
    """What a record lacks of the fields load_lora reads, in words (None: it has them all, of their types)."""
    lora, model = meta.get("lora"), meta.get("model")
    if not isinstance(lora, dict) or not isinstance(model, dict):
        return "has no 'lora' and 'model' objects"
    number = (int, float)
    kinds = {"rank": int, "alpha": (*number, type(None)), "dropout": number, "targets": list}
    for name, kind in kinds.items():
        if name not in lora or not isinstance(lora[name], kind) or isinstance(lora[name], bool):
            return f"has no valid field 'lora.{name}'"
    if not all(isinstance(t, str) for t in lora["targets"]):
        return "has a 'lora.targets' that is not a list of layer names"
    if not isinstance(model.get("class"), str) or not isinstance(model.get("config"), dict):
        return "has no valid fields 'model.class' and 'model.config'"
    return None


def read_lora_tensors(folder: str | os.PathLike) -> dict:
    """The LoRA tensors of an adapter folder with peft's keys (the `transformer.` prefix of the export removed); a
    weights file cut short or damaged is refused (FileError), and so are peft's files beside it when they are."""
    folder = Path(folder)
    meta = read_lora_config(folder)
    if meta["format"] == FORMAT_V1:
        return read_tensors(folder / PEFT_WEIGHTS, FIX)
    tensors = read_tensors(folder / WEIGHTS, FIX)
    foreign = sorted(k for k in tensors if not k.startswith(PREFIX))
    if foreign:
        raise ConfigError(f"'{folder / WEIGHTS}' holds LoRA tensors of other components ({foreign[:2]}); "
                          "load_lora restores the transformer's only.")
    tensors = {k[len(PREFIX):]: v for k, v in tensors.items()}
    if meta["format"] == FORMAT:
        _check_peft_files(folder, tensors)
    return tensors


def _check_peft_files(folder: Path, tensors: dict) -> None:
    """peft's pair beside the diffusers file (save_lora writes both): whole, and holding the same tensors, so that
    peft and any tool reading them does not fail on a folder load_lora accepted."""
    if (folder / PEFT_CONFIG).exists():
        config = read_json(folder / PEFT_CONFIG, FIX)
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            raise damaged(folder / PEFT_CONFIG, "is not peft's LoRA config (no \"peft_type\": \"LORA\")", FIX)
    if (folder / PEFT_WEIGHTS).exists():
        shapes = tensor_shapes(folder / PEFT_WEIGHTS, FIX)
        if shapes != {PEFT_PREFIX + k: tuple(v.shape) for k, v in tensors.items()}:
            raise damaged(folder / PEFT_WEIGHTS, f"holds other tensors than {WEIGHTS} beside it", FIX)


def load_lora(model: nn.Module, folder: str | os.PathLike) -> LoraSpec:
    """Add (if needed) and fill the LoRA of `folder` on `model`, which must be the class and config it was trained on.

    Anything that cannot be loaded raises ConfigError with a one-sentence message naming the folder or file and the
    fix (FileError, a ConfigError, for a damaged, empty or truncated file). Every file is read and checked before the
    LoRA is added, so a damaged folder, or one of another model, leaves the model as it was."""
    meta = read_lora_config(folder)
    cls, config = meta["model"]["class"], meta["model"]["config"]
    if cls != type(model).__name__:
        raise ConfigError(f"the LoRA in '{folder}' was trained on a {cls}, not a {type(model).__name__}.")
    mine = model_config(model)
    differ = sorted(k for k in set(config) | set(mine) if config.get(k) != mine.get(k))
    if differ:
        changes = "; ".join(f"{k}: {config.get(k)!r} -> {mine.get(k)!r}" for k in differ)  # trained on -> this model's
        raise ConfigError(f"the LoRA in '{folder}' was trained on a {cls} whose config differs in {changes}; load that model.")
    lora = meta["lora"]
    spec = LoraSpec(lora["rank"], lora["alpha"], lora["dropout"], tuple(lora["targets"]))
    if hasattr(model, "_tread_lora") and model._tread_lora != spec:
        raise ConfigError(f"the model already has LoRA {model._tread_lora}, but '{folder}' holds {spec}.")
    tensors = read_lora_tensors(folder)
    if not hasattr(model, "_tread_lora"):
        add_lora(model, spec.rank, spec.alpha, spec.dropout, spec.targets)
    load_lora_state_dict(model, tensors)
    return spec
