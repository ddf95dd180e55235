"""The latent space a `data=latents` run trains in (docs/latents.md, "Fine-tuning on cached latents").

From scratch, `data.normalize: standardize` maps every channel to mean 0 and std edm.sigma_data. A fine-tune must
instead see the latents as its pretrained model was trained on them: the VAE's own (z - shift_factor) *
scaling_factor (`scale`). `auto`, the default, picks `scale` whenever finetune.family is set; `check_latent_space`
refuses, before training starts, an explicit `standardize` on a fine-tune and a cache written by another VAE than
the pretrained pipeline's (its meta.json records the channels, scaling and shift it was encoded with).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from routing.errors import ConfigError
from train.files import read_meta

AUTO = "auto"  # data.normalize's default: scale for a fine-tune, standardize for a model trained from scratch


def _value(cfg: Any, key: str, default: Any = None) -> Any:
    """A key of a DictConfig or dict; a missing ('???') value reads as the default."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.select(cfg, key, default=default, throw_on_missing=False)
    return cfg.get(key, default)


def resolve_normalize(cfg_data: Any) -> str:
    """data.normalize, with `auto` resolved: `scale` when the run fine-tunes a pretrained model (finetune.family, read
    from the config `cfg_data` belongs to), else `standardize`."""
    mode = _value(cfg_data, "normalize", "standardize")
    if mode != AUTO:
        return mode
    return "scale" if _finetune_family(cfg_data) else "standardize"


def _finetune_family(cfg_data: Any) -> str | None:
    from omegaconf import DictConfig, OmegaConf

    # The dataset is built from the data group alone (build_dataset(cfg.data, ...)); its root is the run's config.
    root = cfg_data._get_root() if isinstance(cfg_data, DictConfig) else None
    return OmegaConf.select(root, "finetune.family", default=None) if root is not None else None


def pretrained_vae(pretrained: str | os.PathLike) -> Path | None:
    """The VAE folder of a pretrained pipeline (`vae/` beside `transformer/`), or None for a transformer alone."""
    folder = Path(str(pretrained)).expanduser()
    candidates = [folder / "vae"] + ([folder.parent / "vae"] if folder.name == "transformer" else [])
    return next((vae for vae in candidates if (vae / "config.json").is_file()), None)


def check_latent_space(cfg: Any) -> None:
    """A fine-tune on data=latents trains in the pretrained model's latent space: refuse standardised latents, and a
    cache whose VAE (its meta.json: channels, scaling_factor, shift_factor) is not the pretrained pipeline's VAE."""
    family, mode = cfg.finetune.family, _value(cfg.data, "normalize", "standardize")
    if mode == "standardize":
        raise ConfigError(f"data.normalize=standardize maps each latent channel to mean 0 and std edm.sigma_data, which is not the "
                          f"latent space the pretrained {family} model was trained in (its VAE's (z - shift_factor) * scaling_factor); "
                          "drop data.normalize (auto takes the VAE's) or pass data.normalize=scale.")
    folder = Path(str(_value(cfg.data, "path", ""))).expanduser()
    vae = pretrained_vae(cfg.finetune.pretrained)
    try:
        meta = read_meta(folder)
    except ConfigError:
        return  # the dataset itself refuses a damaged folder, naming data.path
    if vae is None:
        return  # a transformer folder without its pipeline: the cache's own VAE values are all there is
    try:
        config = json.loads((vae / "config.json").read_text())
        model = (int(config.get("latent_channels", meta.latent_shape[0])), float(config.get("scaling_factor", 1.0)),
                 float(config.get("shift_factor") or 0.0))
    except (ValueError, TypeError, AttributeError, OSError):
        return  # not a VAE config we can read; loading the pipeline's VAE refuses it
    cached = (meta.latent_shape[0], meta.scaling_factor, meta.shift_factor)
    if cached[0] != model[0] or not all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(cached[1:], model[1:])):
        raise ConfigError(f"data.path={str(folder)!r} was cached with a VAE of {cached[0]} channels, scaling_factor {cached[1]:g} and "
                          f"shift_factor {cached[2]:g} (its meta.json), but finetune.pretrained's VAE ({vae}) has {model[0]}, "
                          f"{model[1]:g} and {model[2]:g}, so data.normalize=scale would train in another latent space than the "
                          f"model's; re-create the cache with `python -m train.cache_latents --vae {vae} ...`.")
