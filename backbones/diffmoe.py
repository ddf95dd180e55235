"""DiffMoE (Shi et al. 2025): DiT blocks whose MLP is a mixture of E experts, and its baselines.

Block: x += g1 * Attn(modulate(LN(x))); x += g2 * MoE(modulate(LN(x))), i.e. a DiT block with the MLP
swapped for `backbones.ops.moe.MoE`. `moe_mode` picks the routing: `dense` (the plain DiT MLP),
`token_choice`, `expert_choice` (per sample) or `global_pool` (DiffMoE's batch-level pool with a capacity
predictor). With `interleave` only the odd-index blocks are MoE, as in the released DiffMoE config.

Each expert is a full DiT MLP (hidden 4 D), as in the release: with capacity C = 1 (or top_k = 1) a token
activates one expert on average, so the activated parameters per token match the dense DiT of the same size.

The family hooks into the trainer and sampler through module-level functions that walk any wrapper
(EDMPrecond, DDP, the EMA copy): `auxiliary_losses`, `set_inference_capacity`, `capacity_stats`,
`activated_parameters`, `set_train_capacity`. docs/diffmoe.md has the details.
"""

from __future__ import annotations

import torch
from torch import nn

from backbones.dit import Block as DiTBlock
from backbones.ops.moe import MODES, MoE
from routing.errors import ConfigError

# DiT's widths and depths at E16 (DiffMoE-S/B/L-E16); "tiny" (E4) trains in minutes on a CPU.
PRESETS = {
    "tiny": dict(hidden_size=128, depth=8, num_heads=4, num_experts=4),
    "S": dict(hidden_size=384, depth=12, num_heads=6, num_experts=16),
    "B": dict(hidden_size=768, depth=12, num_heads=12, num_experts=16),
    "L": dict(hidden_size=1024, depth=24, num_heads=16, num_experts=16),
}

MOE_MODES = ("dense", *MODES)


class Block(DiTBlock):
    """A DiT block whose MLP is a `MoE` (or stays dense: mode `dense`, or an even block under `interleave`)."""

    needs_grid = False
    # Its MoE records aux losses, loads and threshold updates as it runs: side effects that a nested compile region's
    # body cannot hold (trainer.compile_regions refuses the family).
    records_in_forward = True

    def __init__(
        self,
        hidden_size: int,
        layer_idx: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        *,
        moe_mode: str = "global_pool",
        num_experts: int = 16,
        capacity: float = 1.0,
        top_k: int = 1,
        interleave: bool = True,
        shared_experts: int = 0,
        balance_weight: float = 0.01,
        predictor_weight: float = 1.0,
        threshold_decay: float = 0.95,
        sync_thresholds: bool = True,
    ):
        super().__init__(hidden_size, layer_idx, depth, num_heads, mlp_ratio)
        if moe_mode not in MOE_MODES:
            raise ConfigError(f"backbone.kwargs.moe_mode='{moe_mode}' is unknown; choose one of {list(MOE_MODES)}.")
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"backbone.kwargs.top_k={top_k} must be between 1 and num_experts={num_experts}.")
        if capacity <= 0:
            raise ConfigError(f"backbone.kwargs.capacity={capacity} must be positive (DiffMoE trains with 1).")
        self.is_moe = moe_mode != "dense" and (not interleave or layer_idx % 2 == 1)
        if self.is_moe:
            # The DiT forward is reused as is: only the MLP changes.
            self.mlp = MoE(
                hidden_size,
                int(hidden_size * mlp_ratio),
                num_experts,
                moe_mode,
                capacity=capacity,
                top_k=top_k,
                shared_experts=shared_experts,
                threshold_decay=threshold_decay,
                sync_thresholds=sync_thresholds,
                aux_weights={"balance": balance_weight, "capacity_predictor": predictor_weight},
            )


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE layers inside `module` (a Backbone, EDMPrecond, a DDP wrapper, ...), in block order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def auxiliary_losses(module: nn.Module) -> dict[str, torch.Tensor]:
    """Weighted aux losses of the last training forward, summed over MoE blocks: {"moe_balance": ..., ...}.

    Empty for models without MoE layers, so a trainer may call it for every backbone and add the sum.
    Call it after each forward (before the next one overwrites the records).
    """
    totals: dict[str, torch.Tensor] = {}
    for layer in moe_layers(module):
        for name, loss in layer.aux_losses.items():
            weighted = layer.aux_weights[name] * loss
            totals[f"moe_{name}"] = totals[f"moe_{name}"] + weighted if f"moe_{name}" in totals else weighted
    return totals


def set_inference_capacity(module: nn.Module, threshold: float | None = None, target: float | None = None) -> None:
    """Control the dynamic capacity of `global_pool` layers in eval mode.

    Both None: the learned per-expert thresholds (EMA from training). `threshold`: one probability threshold
    for every expert. `target`: the average number of activated experts per token; each layer picks, on the
    current batch, the threshold that makes it so (exact up to ties). Training is unaffected.
    """
    if threshold is not None and target is not None:
        raise ConfigError("set either the capacity threshold or the capacity target, not both.")
    layers = [m for m in moe_layers(module) if m.mode == "global_pool"]
    if (threshold is not None or target is not None) and not layers:
        raise ConfigError(
            "a capacity threshold/target needs backbone=diffmoe with backbone.kwargs.moe_mode=global_pool."
        )
    for layer in layers:
        layer.inference_threshold, layer.inference_target = threshold, target


def set_train_capacity(module: nn.Module, capacity: float) -> None:
    """Training capacity C of expert/global-pool layers, for DiffMoE's optional schedule (C = E, then decay to 1)."""
    for layer in moe_layers(module):
        layer.capacity = capacity


def capacity_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    """Load of the last forward: activated experts per token, per MoE layer and sample.

    Returns {"per_layer": (L, B), "per_sample": (B,) mean over layers, "mean": ()}; empty without MoE layers.
    A sampler calls it after each network evaluation to plot compute against the step and the class.
    """
    loads = [m.last_load for m in moe_layers(module) if m.last_load is not None]
    if not loads:
        return {}
    per_layer = torch.stack(loads)  # L x (B,) -> (L, B)
    return {"per_layer": per_layer, "per_sample": per_layer.mean(0), "mean": per_layer.mean()}


def activated_parameters(module: nn.Module, experts_per_token: float | str | None = None, router: bool = True) -> float:
    """Parameters a token activates: all, minus the routed experts, plus `experts_per_token` experts per MoE layer.

    experts_per_token: None -> the training value (top_k for token choice, C for expert/global pool);
    a number -> that for every layer; "measured" -> each layer's average load of the last forward.
    router=False leaves out the gate and capacity predictor (the count DiffMoE's table appears to use).
    """
    total = float(sum(p.numel() for p in module.parameters()))
    for layer in moe_layers(module):
        per_expert = layer.experts.params_per_expert()
        if experts_per_token is None:
            active = layer.top_k if layer.mode == "token_choice" else min(layer.capacity, layer.num_experts)
        elif experts_per_token == "measured":
            active = float(layer.last_load.mean())
        else:
            active = float(experts_per_token)
        total += (active - layer.num_experts) * per_expert
        if not router:
            total -= layer.gate_weight.numel()
            total -= sum(p.numel() for p in layer.predictor.parameters()) if layer.predictor is not None else 0
    return total
