"""Config -> the run's representation alignment (`align:`): the model-side `Alignment` with, for REPA, its frozen
encoder (docs/alignment.md). Kept beside the encoder, the one part of alignment that lives in train."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from backbones.align import Alignment
from routing.errors import ConfigError
from train.metrics.encoder import CachedFeatures, FrozenEncoder


def align_name(cfg: DictConfig) -> str:
    """The alignment a config trains with; configs written before `align` existed trained none."""
    return (cfg.get("align") or {}).get("name", "none")


def zero_weight_note(cfg: DictConfig) -> str | None:
    """The line that names an alignment at weight 0 (it runs, and adds nothing); None otherwise. Not refused: weight 0
    is the control that keeps every draw of an aligned run (tests/test_align_trainer.py)."""
    name = align_name(cfg)
    if name == "none" or cfg.align.weight != 0:
        return None
    work = "the EMA teacher's forward and the projector" if name == "self" else "the frozen encoder and the projector"
    return (f"align.weight=0: align={name} runs every step ({work}) but adds nothing to the loss, so nothing is aligned; "
            "set align=none to skip that work, or a weight above 0 to align.")


def build_alignment(cfg: DictConfig, backbone: nn.Module, device: torch.device | str = "cpu",
                    encoder_dtype: torch.dtype = torch.bfloat16, dataset=None) -> Alignment | None:
    """The Alignment of cfg.align on `backbone` (hooks attached now), on `device`; None for align=none.

    REPA loads its encoder from the local weights (refusing a missing file, an unknown name, a patch grid that
    cannot pool onto backbone.grid), or on cached latents reads what the cache stored beside them (`source`, below);
    self-alignment needs nothing but the backbone.
    """
    name = align_name(cfg)
    if name == "none":
        return None
    a = cfg.align
    targets, source = (_repa_targets(a, backbone, device, encoder_dtype, dataset) if name == "repa" else (None, None))
    alignment = Alignment(backbone, name, a.layer, weight=a.weight, width=a.projector_width, target_dim=targets.dim if targets else None,
                          loss=a.get("loss"), teacher_layer=a.teacher_layer, teacher=a.teacher, teacher_gap=a.teacher_gap, targets=targets,
                          head=a.get("head"))
    alignment.source = source  # what the trainer hands over as `clean`: None (the batch is pixels), "images" or "features"
    return alignment.to(device)


def _repa_targets(a: DictConfig, backbone: nn.Module, device, dtype, dataset) -> tuple:
    """(targets, source): the encoder on the batch's pixels; on cached latents, the stored features (pooled, no encoder)
    or the encoder on the stored images."""
    cached = getattr(dataset, "align", None)
    if cached is None:  # pixel data: the batch itself is the clean image
        return FrozenEncoder.load(a.encoder, a.weights, a.input_size, backbone.grid, device, dtype), None
    if "features" in cached:
        how = cached["features"]
        if how["encoder"] != a.encoder or how["input_size"] != a.input_size:
            raise ConfigError(f"data.path holds {how['encoder']} features at {how['input_size']} pixels, but align.encoder={a.encoder} and "
                              f"align.input_size={a.input_size}; set those to the cache's (align.encoder={how['encoder']} "
                              f"align.input_size={how['input_size']}) or cache the features of this encoder.")
        return CachedFeatures(how["grid"], how["dim"], backbone.grid, how["input_size"]), "features"
    if "images" in cached:
        return FrozenEncoder.load(a.encoder, a.weights, a.input_size, backbone.grid, device, dtype), "images"
    raise ConfigError("align=repa encodes the clean images, but this latents folder holds neither them nor their encoder features; "
                      "re-cache it with `python -m train.cache_latents ... --align-images 224` (or --align-encoder NAME --align-weights "
                      "FILE) into a new --out folder, or use align=self.")
