"""`sample:` the training-time preview grids (one row per class, fixed seed)."""

from __future__ import annotations

from dataclasses import dataclass

from train.schema.keys import key


@dataclass
class SampleConfig:
    per_class: int = key(8, "samples per class (one grid row per class)", ge=1, le=1024, example=8)
    steps: int = key(18, "sampler steps", ge=1, le=10000, example=18)
    guidance: float = key(1.0, "classifier-free guidance scale w (1: off)", ge=0, le=100, example=1.5)
    seed: int = key(0, "noise seed of the grid", ge=0, example=0)
