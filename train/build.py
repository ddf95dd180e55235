"""Config -> objects: dataset-shaped backbone with its router, wrapped in EDM preconditioning."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from backbones import Backbone, build_backbone
from edm import EDMPrecond
from routing import ConfigError, Router, build_policy, resolve_routes


def build_router(cfg_routing: DictConfig, model: Backbone) -> Router:
    """Validated router for `model`; fails at start-up when the policy and the blocks do not fit."""
    policy = build_policy(cfg_routing.policy, **(cfg_routing.get("policy_kwargs") or {}))
    routes = resolve_routes(OmegaConf.to_container(cfg_routing.routes, resolve=True) or [], model.depth)
    for route in routes:
        policy.check(model.grid, route.selection_ratio)
    if routes and model.block_cls.needs_grid and not policy.yields_grid and not cfg_routing.allow_unstructured:
        raise ConfigError(
            f"backbone '{model.family}' scans tokens on a 2-D grid, but routing policy '{policy.name}' picks tokens "
            "without one; use routing=rows (or set routing.allow_unstructured=true to treat the subset as 1-D, an ablation)."
        )
    return Router(policy, routes, force=cfg_routing.force, fp32_after_route=cfg_routing.fp32_after_route)


def build_backbone_for(cfg: DictConfig, shape: tuple[int, int, int], num_classes: int) -> Backbone:
    b = cfg.backbone
    model = build_backbone(
        b.name,
        b.preset,
        input_size=tuple(shape[1:]),
        in_channels=shape[0],
        patch_size=b.patch_size,
        num_classes=num_classes,
        depth=b.get("depth"),
        hidden_size=b.get("hidden_size"),
        **(b.get("kwargs") or {}),
    )
    model.router = build_router(cfg.routing, model)
    return model


def build_net(cfg: DictConfig, dataset) -> EDMPrecond:
    """The trained denoiser D(x; sigma, labels) for `dataset`."""
    return EDMPrecond(build_backbone_for(cfg, dataset.shape, dataset.num_classes), sigma_data=cfg.edm.sigma_data)
