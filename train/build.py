"""Config -> objects: dataset-shaped backbone with its router, wrapped by the training objective (EDM or flow)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf
from torch import nn

from backbones import Backbone, build_backbone
from edm import Objective, build_objective
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


def objective_name(cfg: DictConfig) -> str:
    """The objective a config trains with; configs written before objectives existed trained EDM."""
    return (cfg.get("objective") or {}).get("name", "edm")


def objective_for(cfg: DictConfig) -> Objective:
    """The objective named by `objective.name`; EDM's settings stay under `edm:` where they have always been."""
    spec = {k: v for k, v in OmegaConf.to_container(cfg.get("objective") or OmegaConf.create({}), resolve=True).items() if k != "name"}
    name = objective_name(cfg)
    if name == "edm":
        spec = {"sigma_data": cfg.edm.sigma_data, "P_mean": cfg.edm.P_mean, "P_std": cfg.edm.P_std, **spec}
    try:
        return build_objective(name, **spec)
    except ValueError as err:  # edm knows nothing of ConfigError; its messages already name the key
        raise ConfigError(str(err)) from err


def build_net(cfg: DictConfig, dataset) -> nn.Module:
    """The trained network for `dataset`: D(x; sigma, labels) for EDM, v(z, t, labels) for flow."""
    return objective_for(cfg).wrap(build_backbone_for(cfg, dataset.shape, dataset.num_classes))


def compile_blocks(model: Backbone) -> None:
    """torch.compile every block in place (`trainer.compile=true`), so state-dict keys stay unchanged.

    Blocks of one family share their code and dynamo treats their parameters as inputs, so the whole stack
    reuses a few graphs: one per token count (the full sequence and each route's subset, static for a config,
    hence dynamic=False), per autocast state (the fp32 block after a route) and per Python constant that
    differs between layers (Mamba's scan order). The recompile limit is raised to fit them all.
    """
    import torch._dynamo

    limit = 4 * len(model.blocks)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 8 * limit)
    for block in model.blocks:
        block.compile(dynamic=False)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (reported after the first compiled steps)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
