"""Backbone families behind one constructor; each family module exports `Block` and `PRESETS`."""

from __future__ import annotations

import importlib

from backbones.common import Backbone
from routing.errors import ConfigError

FAMILIES = {
    "dit": "backbones.dit",
    "rwkv": "backbones.rwkv",
    "mamba": "backbones.mamba",
    "diffmoe": "backbones.diffmoe",
}


def family_module(name: str):
    if name not in FAMILIES:
        raise ConfigError(f"backbone.name='{name}' is unknown; choose one of {sorted(FAMILIES)} (e.g. backbone=dit).")
    return importlib.import_module(FAMILIES[name])


def build_backbone(
    name: str,
    preset: str,
    *,
    input_size: int | tuple[int, int],
    in_channels: int,
    patch_size: int,
    num_classes: int,
    **overrides,
) -> Backbone:
    """Build family `name` at size `preset`; `overrides` replace preset entries (e.g. depth=4)."""
    module = family_module(name)
    if preset not in module.PRESETS:
        raise ConfigError(f"backbone.preset='{preset}' is unknown for {name}; choose one of {list(module.PRESETS)}.")
    spec = {**module.PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    return Backbone(
        module.Block,
        input_size=input_size,
        in_channels=in_channels,
        patch_size=patch_size,
        num_classes=num_classes,
        family=name,
        **spec,
    )


__all__ = ["Backbone", "FAMILIES", "build_backbone", "family_module"]
