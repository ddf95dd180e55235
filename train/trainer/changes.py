"""What a resumed run may change: every difference between the checkpoint's config and this run's, classified
before any weight is loaded, each with one sentence.

- refused, naming the key and the value trained with: what adds, removes or moves parameters (the backbone, the
  data's shape, the objective, a LoRA's rank and targets), what changes what the weights mean (the seed,
  edm.sigma_data), a SPRINT route's span and kind (its fusion layer belongs to those blocks; adding or removing it
  adds or removes parameters) and the policy of a route that fuses (its fusion was trained on that token layout);
- allowed with a printed warning: what keeps every parameter but changes what the weights are trained on from here
  (TREAD routes and their policy, the loss weighting and noise levels, the global batch, the precision);
- allowed and printed: the rest (SPRINT's second stage, lr, max_steps, intervals, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from train.schema import resume_changes

# Allowed with a warning: key prefix -> why it deserves one.
WARN = {
    "routing.": "the weights continue under other routes than they were trained with, so the loss may jump before it settles",
    "edm.": "the loss weighting or noise levels the weights were trained with change",
    "trainer.batch_size": "each later step draws another share of the data order, so the run no longer repeats an "
                          "uninterrupted one",
    "trainer.mixed_precision": "the step's numerics change from here on",
}
# Refused keys whose change adds, removes or moves parameters (or what a parameter belongs to): the checkpoint does not
# fit the model this config builds. The others (the seed, edm.sigma_data) change what the weights mean.
PARAMETER_KEYS = ("backbone.", "data.", "objective.", "finetune.", "routing.")
FUSING_ROUTE = "the SPRINT route's fusion layer was trained on this policy's token layout"
ADDED_FUSION = "the checkpoint has no SPRINT route, whose fusion layer this config adds"


@dataclass
class Changes:
    refused: list[str] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)


def _plain(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, (DictConfig, ListConfig)) else cfg


def _fuses(cfg: Any) -> bool:
    routes = ((_plain(cfg) or {}).get("routing") or {}).get("routes") or []
    return any(isinstance(r, dict) and r.get("mode") == "sprint" for r in routes)


def classify(saved: Any, current: Any) -> Changes:
    """Every key that differs between the checkpoint's config (`saved`) and this run's, as 'key: old -> new' with,
    where it helps, why; sorted into refused, warned and applied."""
    refused, applied = resume_changes(saved, current)
    out = Changes(refused=list(refused))
    fuses = _fuses(saved) or _fuses(current)
    for change in applied:
        key = change.split(":", 1)[0]
        if fuses and (key == "routing.policy" or key.startswith("routing.policy_kwargs")):
            out.refused.append(f"{change} ({FUSING_ROUTE if _fuses(saved) else ADDED_FUSION})")
        elif key.startswith("routing.routes[") and fuses:
            out.applied.append(change)  # a SPRINT route's ratio or path drop: its second stage
        elif (why := next((w for prefix, w in WARN.items() if key.startswith(prefix)), None)) is not None:
            out.warned.append(f"{change} ({why})")
        else:
            out.applied.append(change)
    return out


def refusal(path: Any, refused: list[str]) -> str:
    """The one sentence that refuses a resume: the keys that do not fit the model, then those that cannot change."""
    fit = [c for c in refused if c.startswith(PARAMETER_KEYS)]
    meaning = [c for c in refused if not c.startswith(PARAMETER_KEYS)]
    parts = ([f"does not fit this model: it was trained with other values of keys that add, remove or move parameters "
              f"({'; '.join(fit)})"] if fit else []) + \
            ([f"was trained with other values of keys that cannot change on resume ({'; '.join(meaning)})"] if meaning else [])
    return f"checkpoint '{path}' {' and '.join(parts)}; resume with the saved values or start a new run_dir."

