"""LoRA (peft) on a pretrained diffusers transformer: which layers, injection, and the LoRA tensors in memory.

- `add_lora(model, rank=..., targets=...)`: freezes every base weight and adds LoRA to the target layers;
  `targets` is a preset (TARGET_PRESETS: attention, attention_mlp, all_linear) or a list of layer names;
- `lora_targets(model, targets)`: the layers a preset or a list names in this model, resolved before injection,
  so a run can print how many it trains;
- `lora_state_dict` / `load_lora_state_dict`: the LoRA tensors with peft's keys, for a trainer's checkpoints.
The files a LoRA is exported to are lora_files.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from routing import ConfigError

# Attention projections LoRA adapts by default; only those the model has are targeted.
ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
# The feed-forward layers of each family's blocks. A Flux single-stream block has no `ff`: its `proj_mlp` is the
# MLP's input and its `proj_out` the shared output of attention and MLP (so it is only matched inside the blocks,
# never the model's final `proj_out`).
FEED_FORWARD = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out")
# The block stacks the adapters route (Flux: both; Wan: blocks); LoRA presets and lists only match layers inside them.
BLOCK_STACKS = ("transformer_blocks.", "single_transformer_blocks.", "blocks.")
TARGET_PRESETS = {
    "attention": "the attention projections (q, k, v, out; and the text stream's in joint attention)",
    "attention_mlp": "attention projections and the feed-forward layers of every block",
    "all_linear": "every linear layer of the blocks (adaLN modulation included)",
}


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 16
    alpha: float | None = None  # None: alpha = rank (scale 1)
    dropout: float = 0.0
    targets: tuple[str, ...] = ATTENTION_PROJECTIONS


def present_targets(model: nn.Module, targets) -> list[str]:
    """The names of `targets` some module of `model` has, as itself or as the end of its path (peft's matching)."""
    names = [name for name, _ in model.named_modules()]
    return [t for t in targets if any(n == t or n.endswith("." + t) for n in names)]


def block_linears(model: nn.Module) -> list[str]:
    """Full paths of the nn.Linear layers inside the model's block stacks, in model order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(BLOCK_STACKS) and ".lora_" not in n]


def lora_targets(model: nn.Module, targets: str | Sequence[str] = "attention") -> tuple[str, ...]:
    """The layers `targets` names in `model`: a preset of TARGET_PRESETS, or layer names matched inside the blocks.

    `attention` keeps the short projection names peft matches anywhere (every attention lives in a block); the
    other presets and lists resolve to full layer paths, so a name like `proj_out` cannot reach the output layer.
    """
    if isinstance(targets, str):
        if targets not in TARGET_PRESETS:
            raise ConfigError(f"finetune.lora.targets={targets!r} is unknown; choose a preset ({', '.join(TARGET_PRESETS)}) "
                              "or a list of layer names, e.g. finetune.lora.targets=[to_q,to_k,to_v,proj_mlp].")
        if targets == "attention":
            return tuple(present_targets(model, ATTENTION_PROJECTIONS))
        linears = block_linears(model)
        if targets == "all_linear":
            return tuple(linears)
        return tuple(n for n in linears if n.endswith(tuple("." + s for s in ATTENTION_PROJECTIONS + FEED_FORWARD)))
    names = [str(t) for t in targets]
    linears = block_linears(model)
    found = tuple(n for n in linears if any(n.endswith("." + t) for t in names))
    unmatched = [t for t in names if not any(n.endswith("." + t) for n in linears)]
    if unmatched or not found:
        known = sorted({n.split(".", 2)[2] for n in linears})
        raise ConfigError(f"finetune.lora.targets names {unmatched or names}, which match no linear layer in the blocks of this "
                          f"{type(model).__name__}; its layers are {', '.join(known)}.")
    return found


def add_lora(model: nn.Module, rank: int = 16, alpha: float | None = None, dropout: float = 0.0,
             targets: str | Sequence[str] = ATTENTION_PROJECTIONS) -> LoraSpec:
    """Freeze the model and add LoRA (B = 0, so the output is unchanged) to `targets`: a preset name, or layer
    names (peft matching: a module whose path is the name or ends with it)."""
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ConfigError(f"lora.rank={rank} must be a positive integer.")
    found = list(lora_targets(model, targets)) if isinstance(targets, str) else present_targets(model, targets)
    if not found:
        raise ConfigError(f"lora.targets={list(targets)} match no module of this {type(model).__name__}.")
    spec = LoraSpec(rank, alpha, dropout, tuple(found))
    model.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, lora_dropout=dropout,
                        target_modules=found, init_lora_weights=True)
    inject_adapter_in_model(config, model)
    for p in lora_parameters(model):
        # peft creates the adapters in the base's dtype; a bf16 base still trains fp32 LoRA weights, whose
        # small updates bf16 would round away.
        p.data = p.data.float()
        p.requires_grad_(True)
    model._tread_lora = spec
    return spec


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if ".lora_" in name]


def lora_layers(model: nn.Module) -> int:
    """How many layers carry a LoRA (each trains two tensors, A and B)."""
    return sum(1 for name, _ in model.named_parameters() if name.endswith(".lora_A.default.weight"))


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA tensors, keyed by module path without the adapter name (peft's format)."""
    from peft import get_peft_model_state_dict

    if not hasattr(model, "_tread_lora"):
        raise ConfigError(f"this {type(model).__name__} has no LoRA; call add_lora(model, ...) first.")
    return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_lora_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy LoRA tensors into the model's LoRA layers; every key must match, both ways."""
    from peft import set_peft_model_state_dict

    expected = set(lora_state_dict(model))
    if set(tensors) != expected:
        missing, unknown = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ConfigError(f"LoRA tensors do not match this model's adapters (missing {missing[:3]}, unknown {unknown[:3]}).")
    result = set_peft_model_state_dict(model, tensors)
    if getattr(result, "unexpected_keys", None):
        raise ConfigError(f"peft did not place LoRA tensors {result.unexpected_keys[:3]}.")
