"""`fid:` periodic FID of the EMA model during training (docs/latents.md); off while `every` is 0."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from train.schema.keys import key


@dataclass
class FIDConfig:
    every: int = key(0, "steps between evaluations (0: off)", ge=0, example=10000)
    ref: Optional[str] = key(None, ".npz with mu/sigma (e.g. ADM's reference batch) or a folder of real images", example="ref.npz")
    num_samples: int = key(10000, "generated samples per evaluation", ge=2, example=50000)
    steps: int = key(40, "sampler steps", ge=1, le=10000, example=40)
    guidance: float = key(1.0, "classifier-free guidance scale w (1: off)", ge=0, le=100, example=1.5)
    sampler: str = key("heun", "sampler", choices=("heun", "euler"), example="heun")
    batch_size: int = key(64, "samples per global batch; also the Inception batch", ge=1, example=64)
    seed: int = key(0, "seed of the first batch", ge=0, example=0)
    inception: Optional[str] = key(None, "local Inception weights file (null: torch hub's checkpoints folder)", example="pt_inception.pth")
    route_ratio: float = key(0.0, "routed inference: routing forced at this ratio over the trained routes (0: off)", ge=0, lt=1, example=0.5)
    rg_scale: float = key(1.0, "routing guidance w (1: off)", ge=0, le=100, example=1.5)
    rg_gamma1: Optional[float] = key(None, "routing guidance: the strong branch's ratio (null: unrouted)", ge=0, lt=1, example=0.0)
    rg_gamma2: float = key(0.5, "routing guidance: the weak branch's ratio", ge=0, lt=1, example=0.5)
    rg_uncond: bool = key(False, "routing guidance: both branches unconditional (the released sample_tread)")
    pdg_scale: float = key(1.0, "SPRINT's path-drop guidance w (1: off); in place of CFG, for routing=sprint models", ge=0, le=100, example=3.0)
    moe_threshold: Optional[float] = key(None, "DiffMoE: one capacity threshold for every expert", ge=0, le=1, example=0.5)
    moe_target: Optional[float] = key(None, "DiffMoE: average activated experts per token (both null: learned thresholds)", gt=0, example=1.0)
