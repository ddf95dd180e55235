"""Pretrained diffusers transformers under TREAD routing, LoRA and adapter-only checkpoints.

    model = load_pretrained("flux", "weights/flux-dev")            # local folder only
    add_lora(model, rank=16)                                        # base frozen, LoRA on attention
    net = adapt(model, policy="random", routes=[{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}])
    v = net(z_t, t, {"encoder_hidden_states": ..., "pooled_projections": ..., "force_keep": mask})
    save_lora(model, "run/lora")
    net = PromptConditioned(adapt(model), table)                    # net(x, t, class_labels) through class prompts

Supported (diffusers 0.42, the version these adapters re-run the forwards of): FluxTransformer2DModel,
SD3Transformer2DModel, PixArtTransformer2DModel, DiTTransformer2DModel, WanTransformer3DModel (video).
"""

from __future__ import annotations

import warnings

from torch import nn

from backbones.adapters.common import DIFFUSERS_TESTED, RoutedTransformer, Stream, make_router, token_mask
from backbones.adapters.dit import DiTAdapter, keep_labels
from backbones.adapters.flux import FluxAdapter
from backbones.adapters.lora import (
    ATTENTION_PROJECTIONS,
    TARGET_PRESETS,
    LoraSpec,
    add_lora,
    load_lora_state_dict,
    lora_layers,
    lora_parameters,
    lora_state_dict,
    lora_targets,
)
from backbones.adapters.lora_files import LORA_PIPELINES, load_lora, save_lora
from backbones.adapters.pretrained import PRETRAINED, family_of, load_pretrained, model_config, pretrained_folder, resolution_shift
from backbones.adapters.pixart import PixArtAdapter
from backbones.adapters.prompts import TABLE_KEYS, PromptConditioned
from backbones.adapters.sd3 import SD3Adapter
from backbones.adapters.wan import WanAdapter
from routing import ConfigError, Router, RoutingPolicy

ADAPTERS: dict[str, type[RoutedTransformer]] = {a.model_class: a for a in (FluxAdapter, SD3Adapter, PixArtAdapter, DiTAdapter, WanAdapter)}
FAMILIES: dict[str, type[RoutedTransformer]] = {a.family: a for a in ADAPTERS.values()}


def adapt(model: nn.Module, router: Router | None = None, *, policy: str | RoutingPolicy | None = None,
          routes=None, **router_kwargs) -> RoutedTransformer:
    """Wrap a diffusers transformer so its image tokens run through a Router.

    Give either a ready `router` (its routes already resolved against `net.depth`), or `policy` and `routes`
    (dicts {selection_ratio, start_layer_idx, end_layer_idx}, negative indices from the end), resolved here.
    """
    name = type(model).__name__
    if name not in ADAPTERS:
        raise ConfigError(f"no TREAD adapter for {name}; supported: {sorted(ADAPTERS)}.")
    import diffusers

    if not diffusers.__version__.startswith(DIFFUSERS_TESTED + "."):
        warnings.warn(
            f"the TREAD adapters mirror the forwards of diffusers {DIFFUSERS_TESTED}.x, this is {diffusers.__version__}; "
            "run tests/test_adapters.py (ratio 0 must equal the model's own forward) before trusting them.",
            stacklevel=2,
        )
    net = ADAPTERS[name](model)
    if router is not None and (policy is not None or routes is not None or router_kwargs):
        raise ConfigError("give adapt() either a router or policy/routes, not both.")
    net.router = router if router is not None else make_router(net.depth, policy, routes, **router_kwargs)
    return net


__all__ = [
    "ADAPTERS", "ATTENTION_PROJECTIONS", "DIFFUSERS_TESTED", "FAMILIES", "LORA_PIPELINES", "PRETRAINED", "TABLE_KEYS",
    "TARGET_PRESETS", "DiTAdapter", "FluxAdapter", "LoraSpec", "PixArtAdapter", "PromptConditioned", "RoutedTransformer",
    "SD3Adapter", "Stream", "WanAdapter", "adapt", "add_lora", "family_of", "keep_labels", "load_lora", "load_lora_state_dict",
    "load_pretrained", "lora_layers", "lora_parameters", "lora_state_dict", "lora_targets", "model_config",
    "pretrained_folder", "resolution_shift", "save_lora", "token_mask",
]
