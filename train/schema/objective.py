"""`objective:` the training objective, one schema per name (EDM keeps its settings under `edm:`)."""

from __future__ import annotations

from dataclasses import dataclass

from train.schema.keys import REFUSE, key


@dataclass
class EDMObjective:
    name: str = key("edm", "objective: edm | flow", example="edm", on_resume=REFUSE)


@dataclass
class FlowObjective:
    name: str = key("flow", "objective: edm | flow", example="flow", on_resume=REFUSE)
    time_dist: str = key("logit_normal", "training time distribution", choices=("logit_normal", "uniform"), example="logit_normal")
    loc: float = key(0.0, "logit-normal location m", ge=-10, le=10, example=0.0)
    scale: float = key(1.0, "logit-normal scale s", gt=0, le=10, example=1.0)
    shift: float = key(1.0, "sampling time-grid shift (SD3); 1: uniform steps", gt=0, le=100, example=3.0)


OBJECTIVES = {"edm": EDMObjective, "flow": FlowObjective}
