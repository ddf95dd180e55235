"""`sample:` the training-time preview grids (one row per class, or per validation prompt; fixed seed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from train.schema.keys import key


@dataclass
class SampleConfig:
    per_class: int = key(8, "samples per class (one grid row per class)", ge=1, le=1024, example=8)
    steps: int = key(18, "sampler steps", ge=1, le=10000, example=18)
    guidance: float = key(1.0, "classifier-free guidance scale w (1: off)", ge=0, le=100, example=1.5)
    seed: int = key(0, "noise seed of the grid", ge=0, example=0)
    # SimpleTuner's validation prompts: a text-to-image fine-tune's previews otherwise show its first 4 sorted captions.
    prompts: Any = key(None, "validation prompts of a text-to-image fine-tune's preview grids, one row each (sample.per_class "
                       "samples): a list, or the path of a text file with one prompt per line, which `python -m train.sample "
                       "--prompts-file` also reads (null: the first captions, or the classes)",
                       example='["a photo of sks dog","sks dog on a beach"]')
    # One period for every run; the per-experiment files set trainer.sample_every, so this key is the one to override.
    every: Optional[int] = key(None, "steps between preview grids (SimpleTuner's validation steps); null: trainer.sample_every, "
                               "a number replaces it (0: off)", ge=0, example=100)


def preview_every(cfg: Any) -> int:
    """Steps between preview grids: sample.every when set, else trainer.sample_every (0: no previews)."""
    every = (cfg.get("sample") or {}).get("every")
    return int(cfg.trainer.sample_every if every is None else every)
