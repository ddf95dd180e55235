"""Pretrained diffusers transformers from a local folder, never from the network.

- `load_pretrained(family, path)`: the family's transformer from `path` or its `transformer/` (a pipeline folder);
  a missing folder is a ConfigError naming what to fetch.
- `model_config(model)`: the config that fixes the model's shape, which LoRA files and checkpoints record.
- `family_of(model)`: the family name of a diffusers transformer ("flux", "sd3", "pixart", "dit").
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from backbones.files import read_config, tensor_shapes
from routing import ConfigError

# What to fetch for each family: the diffusers class and a public checkpoint of it (for the error message).
PRETRAINED = {
    "flux": ("FluxTransformer2DModel", "black-forest-labs/FLUX.1-dev"),
    "sd3": ("SD3Transformer2DModel", "stabilityai/stable-diffusion-3.5-medium"),
    "pixart": ("PixArtTransformer2DModel", "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS"),
    "dit": ("DiTTransformer2DModel", "facebook/DiT-XL-2-256"),
    "wan": ("WanTransformer3DModel", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
}


def model_class(family: str):
    if family not in PRETRAINED:
        raise ConfigError(f"pretrained family '{family}' is unknown; choose one of {sorted(PRETRAINED)}.")
    import diffusers

    return getattr(diffusers, PRETRAINED[family][0])


def family_of(model: nn.Module) -> str:
    name = type(model).__name__
    found = [family for family, (cls, _) in PRETRAINED.items() if cls == name]
    if not found:
        raise ConfigError(f"no pretrained family holds a {name}; supported: {sorted(c for c, _ in PRETRAINED.values())}.")
    return found[0]


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
    found = read_config(folder / "config.json", f"fetch the model again, e.g. `huggingface-cli download {repo} --include "
                                                 f"'transformer/*' --local-dir {root}`").get("_class_name")
    if found not in (None, name):
        raise ConfigError(f"{what} '{folder}' holds a {found}, not the {name} that family '{family}' needs.")
    return folder


def dtype_kwarg(dtype: torch.dtype | None) -> dict:
    """from_pretrained's dtype argument: diffusers 0.40 renamed torch_dtype to dtype and warns on the old name (in
    every caption run's output); older releases know only torch_dtype."""
    import diffusers
    from packaging.version import Version

    return {"dtype" if Version(diffusers.__version__) >= Version("0.40") else "torch_dtype": dtype}


def load_pretrained(family: str, path: str | os.PathLike, torch_dtype: torch.dtype | None = None) -> nn.Module:
    """The family's diffusers transformer from `path` (its folder, or a pipeline folder with transformer/)."""
    folder = pretrained_folder(family, path)
    weights = ("diffusion_pytorch_model*.safetensors", "diffusion_pytorch_model*.bin", "*.index.json")
    if not any(any(folder.glob(pattern)) for pattern in weights):
        # diffusers would print a warning and fail deep in from_pretrained (an OSError "no file named ...").
        repo = PRETRAINED[family][1]
        fetch = (f"`huggingface-cli download {repo} --include 'transformer/*' --local-dir {folder.parent}`"
                 if folder.name == "transformer" else f"the files of {repo}'s transformer/ folder, beside config.json")
        raise ConfigError(f"'{folder}' holds the {PRETRAINED[family][0]}'s config.json but no weights "
                          "(diffusion_pytorch_model.safetensors, its shards with their .index.json, or a .bin); "
                          f"fetch them too, e.g. {fetch}.")
    for weights in sorted(folder.glob("*.safetensors")):  # whole, from their headers: a download cut short is named
        tensor_shapes(weights, f"fetch the model again ({PRETRAINED[family][1]}); a download that stopped leaves such a file")
    try:
        return model_class(family).from_pretrained(folder, **dtype_kwarg(torch_dtype), local_files_only=True)
    except ValueError as error:  # diffusers: a weight whose shape is not the one config.json builds
        found = re.search(r"(\S+) expected shape torch.Size\((.+?)\), but got torch.Size\((.+?)\)", str(error))
        if found is None:
            raise
        name, built, stored = found.groups()
        raise ConfigError(f"the weights in '{folder}' do not fit its config.json: {name} is {stored} there, {built} as "
                          f"config.json builds it; fetch config.json and the weights together again ({PRETRAINED[family][1]}).") from None


def resolution_shift(path: str | os.PathLike | None = None):
    """Flux's resolution-dependent time shift as a function of the image tokens: exp(mu), mu linear in the tokens.

    The constants are the pipeline's scheduler config (scheduler/ beside transformer/ in a pipeline folder), else
    diffusers' FlowMatchEulerDiscreteScheduler defaults, which are FLUX.1's (0.5 at 256 tokens, 1.15 at 4096); mu is
    diffusers' own `calculate_shift`, which FluxPipeline uses to shift its sampling grid.
    """
    import math

    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    folder = None if path is None else Path(path).expanduser() / "scheduler"
    found = folder is not None and (folder / "scheduler_config.json").is_file()
    c = (FlowMatchEulerDiscreteScheduler.from_pretrained(folder, local_files_only=True) if found else FlowMatchEulerDiscreteScheduler()).config

    def shift(tokens: int) -> float:
        return math.exp(calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift))

    return shift


def model_config(model: nn.Module) -> dict:
    """The diffusers config that fixes the model's shape, as plain JSON values."""
    # Private diffusers keys (_class_name, _diffusers_version, _name_or_path, ...) describe provenance, not shape.
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    return json.loads(json.dumps(config, default=list))
