"""`edm:` EDM's data scale and noise-level distribution, label dropout and the loss reduction."""

from __future__ import annotations

from dataclasses import dataclass

from train.schema.keys import REFUSE, key


@dataclass
class EDMConfig:
    sigma_data: float = key(0.5, "data standard deviation the preconditioning assumes", gt=0, le=100, example=0.5, on_resume=REFUSE)
    P_mean: float = key(-1.2, "ln(sigma) ~ N(P_mean, P_std^2) during training", ge=-10, le=10, example=-1.2)
    P_std: float = key(1.2, "spread of ln(sigma) during training", gt=0, le=10, example=1.2)
    label_dropout: float = key(0.1, "fraction of labels replaced by the null class (classifier-free guidance)", ge=0, lt=1, example=0.1)
    loss: str = key("plain", "loss reduction: plain (released TREAD code) | route_aware (first TREAD paper)", choices=("plain", "route_aware"), example="plain")
