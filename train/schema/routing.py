"""`routing:` the token-routing policy and its routes, TREAD's or SPRINT's (docs/routing.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from train.schema.keys import key


@dataclass
class RoutingConfig:
    policy: str = key("none", "which tokens a route processes: none | random | rows | l1norm | structured", example="random")
    routes: List[Dict[str, Any]] = key([], "routes: [{selection_ratio, start_layer_idx, end_layer_idx[, mode: tread|sprint, path_drop]}]; "
                                        "negative indices count from the end")
    policy_kwargs: Dict[str, Any] = key({}, "policy-specific arguments, e.g. {random_mix: 0.5} for l1norm, {group: 4, keep: 6} for structured")
    allow_unstructured: bool = key(False, "let grid-needing backbones treat a grid-less token subset as 1-D (an ablation)")
    force: bool = key(False, "route in eval mode too (experiments); TREAD routes only in training")
    fp32_after_route: bool = key(False, "run the block right after a route in fp32 under mixed precision")
