"""Config -> the run's representation alignment (`align:`): the model-side `Alignment` with, for REPA, its frozen
encoder (docs/alignment.md). Kept beside the encoder, the one part of alignment that lives in train."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from backbones.align import Alignment
from train.metrics.encoder import FrozenEncoder


def align_name(cfg: DictConfig) -> str:
    """The alignment a config trains with; configs written before `align` existed trained none."""
    return (cfg.get("align") or {}).get("name", "none")


def build_alignment(cfg: DictConfig, backbone: nn.Module, device: torch.device | str = "cpu",
                    encoder_dtype: torch.dtype = torch.bfloat16) -> Alignment | None:
    """The Alignment of cfg.align on `backbone` (hooks attached now), on `device`; None for align=none.

    REPA loads its encoder from the local weights (refusing a missing file, an unknown name, a patch grid that
    cannot pool onto backbone.grid); self-alignment needs nothing but the backbone.
    """
    name = align_name(cfg)
    if name == "none":
        return None
    a = cfg.align
    encoder = FrozenEncoder.load(a.encoder, a.weights, a.input_size, backbone.grid, device, encoder_dtype) if name == "repa" else None
    alignment = Alignment(backbone, name, a.layer, weight=a.weight, width=a.projector_width, target_dim=encoder.dim if encoder else None,
                          loss=a.get("loss"), teacher_layer=a.teacher_layer, teacher=a.teacher, teacher_gap=a.teacher_gap, targets=encoder)
    return alignment.to(device)
