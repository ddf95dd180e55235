"""`routing:` the TREAD token-routing policy and its routes (docs/routing.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from train.schema.keys import key


@dataclass
class RoutingConfig:
    policy: str = key("none", "which tokens bypass a route: none | random | rows | l1norm", example="random")
    routes: List[Dict[str, Any]] = key([], "routes: [{selection_ratio, start_layer_idx, end_layer_idx}]; negative indices count from the end")
    policy_kwargs: Dict[str, Any] = key({}, "policy-specific arguments, e.g. {random_mix: 0.5} for l1norm")
    allow_unstructured: bool = key(False, "let grid-needing backbones treat a grid-less token subset as 1-D (an ablation)")
    force: bool = key(False, "route in eval mode too (experiments); TREAD routes only in training")
    fp32_after_route: bool = key(False, "run the block right after a route in fp32 under mixed precision")
