"""`backbone:` the block family, its size preset and family-specific keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from train.schema.keys import REFUSE, key


@dataclass
class BackboneConfig:
    name: str = key("dit", "block family (backbone=dit|rwkv|mamba|diffmoe picks it with its defaults)", example="dit", on_resume=REFUSE)
    preset: str = key("tiny", "size preset of the family (DiT: tiny, S, B, L, XL; RWKV and Mamba add paper sizes: python -m train.bench.presets)", example="S", on_resume=REFUSE)
    patch_size: int = key(2, "patch side in pixels (or latent cells); must divide the image size", ge=1, le=64, example=2, on_resume=REFUSE)
    depth: Optional[int] = key(None, "number of blocks (null: the preset's)", ge=1, le=1024, example=12, on_resume=REFUSE)
    hidden_size: Optional[int] = key(None, "width (null: the preset's)", ge=8, le=65536, example=384, on_resume=REFUSE)
    # Checked against the family's Block.__init__ signature; add one with +backbone.kwargs.num_heads=8.
    kwargs: Dict[str, Any] = key({}, "family-specific Block arguments, e.g. +backbone.kwargs.num_heads=8", on_resume=REFUSE)


# What makes sense for the families' Block arguments (backbone.kwargs): their names and types come from each
# Block's signature, their ranges and choices from here (check_config), so a bad one is refused before the model
# is built, not at the first step (Mamba's d_state=0).
KWARG_RANGES = {
    "num_heads": {"ge": 1}, "mlp_ratio": {"gt": 0, "le": 64},
    "d_state": {"ge": 1, "le": 1024}, "expand": {"ge": 1, "le": 16}, "d_conv": {"ge": 1, "le": 64}, "dt_rank": {"ge": 1},
    "headdim": {"ge": 1},
    "num_experts": {"ge": 1, "le": 4096}, "capacity": {"gt": 0}, "top_k": {"ge": 1}, "shared_experts": {"ge": 0},
    "balance_weight": {"ge": 0}, "predictor_weight": {"ge": 0}, "threshold_decay": {"ge": 0, "le": 1},
}
KWARG_CHOICES = {"scan_order": ("row", "alternate"), "ssm": ("mamba1", "mamba2")}


def resolved_backbone(b: Any) -> Dict[str, Any]:
    """`backbone:` as the model is built: depth and hidden_size null -> the preset's, so a resume compares (and names)
    the sizes trained with, never null. An unknown family or preset is returned as it is (check_config names it)."""
    from backbones import FAMILIES, family_module

    out = dict(b)
    presets = family_module(out["name"]).PRESETS if out.get("name") in FAMILIES else {}
    for name in ("depth", "hidden_size"):
        if out.get(name) is None and name in presets.get(out.get("preset"), {}):
            out[name] = presets[out["preset"]][name]
    return out
