"""Training objectives behind one small interface, picked by name (`objective=edm` or `objective=flow`).

An objective bundles what differs between EDM and rectified flow and nothing else:
- `wrap(backbone)`: the network the loss and samplers call, net(x, t, class_labels) (EDM: D, flow: v);
- `sample_time(n, generator)`: per-sample noise levels for training (EDM: sigma, flow: t);
- `loss(net, x, labels, t, noise)`: per-element loss (B, C, H, W), reduced by `reduce_loss`;
- `time_grid(steps)`: the sampler's (N+1,) grid, from pure noise (`grid[0]`) down to 0;
- `samplers`: name -> sampler(model, x, grid, extra_args, callback, disable), started at noise * grid[0].

Time and noise are drawn outside `loss` so the trainer can draw them for the whole global batch with
one seeded generator and slice per process, which keeps runs repeatable across process counts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import nn

from edm.flow import FLOW_SAMPLERS, FlowLoss, FlowModel, LogitNormalTime, UniformTime, flow_times
from edm.loss import EDMLoss, LogNormalSigma
from edm.precond import EDMPrecond
from edm.sampler import SAMPLERS, edm_sigmas


@dataclass
class EDM:
    """Karras et al. 2022: D(x; sigma) with preconditioning, ln(sigma) ~ N(P_mean, P_std^2), Heun on edm_sigmas."""

    sigma_data: float = 0.5
    P_mean: float = -1.2
    P_std: float = 1.2
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0

    name: ClassVar[str] = "edm"
    samplers: ClassVar[dict] = SAMPLERS

    def __post_init__(self):
        self._sigma_dist = LogNormalSigma(self.P_mean, self.P_std)
        self._loss = EDMLoss(self.sigma_data)

    def wrap(self, backbone: nn.Module) -> nn.Module:
        return EDMPrecond(backbone, self.sigma_data)

    def sample_time(self, n: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        return self._sigma_dist(n, generator, device)

    def loss(self, net, x, labels, sigma, noise) -> torch.Tensor:
        return self._loss(net, x, labels, sigma, noise)

    def time_grid(self, steps: int, device=None) -> torch.Tensor:
        return edm_sigmas(steps, self.sigma_min, self.sigma_max, self.rho, device=device)


@dataclass
class Flow:
    """Rectified flow (TREAD's rf.py): v-prediction, t logit-normal or uniform, Euler/Heun from t = 1 to 0."""

    time_dist: str = "logit_normal"  # logit_normal | uniform
    loc: float = 0.0  # logit-normal location m
    scale: float = 1.0  # logit-normal scale s
    shift: float = 1.0  # sampling grid shift (SD3); 1 = uniform steps

    name: ClassVar[str] = "flow"
    samplers: ClassVar[dict] = FLOW_SAMPLERS

    def __post_init__(self):
        dists = {"logit_normal": lambda: LogitNormalTime(self.loc, self.scale), "uniform": UniformTime}
        if self.time_dist not in dists:
            raise ValueError(f"objective.time_dist='{self.time_dist}' is unknown; choose one of {sorted(dists)}.")
        self._time_dist = dists[self.time_dist]()
        self._loss = FlowLoss()

    def wrap(self, backbone: nn.Module) -> nn.Module:
        return FlowModel(backbone)

    def sample_time(self, n: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        return self._time_dist(n, generator, device)

    def loss(self, net, x, labels, t, noise) -> torch.Tensor:
        return self._loss(net, x, labels, t, noise)

    def time_grid(self, steps: int, device=None) -> torch.Tensor:
        return flow_times(steps, self.shift, device=device)


Objective = EDM | Flow
OBJECTIVES = {"edm": EDM, "flow": Flow}


def build_objective(name: str = "edm", **cfg) -> Objective:
    """Objective `name` with its settings; unknown names and keys fail with one sentence naming the fix."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective.name='{name}' is unknown; choose one of {sorted(OBJECTIVES)} (e.g. objective=flow).")
    try:
        return OBJECTIVES[name](**cfg)
    except TypeError as err:
        known = [f.name for f in fields(OBJECTIVES[name])]
        raise ValueError(f"objective={name} got unknown settings {sorted(set(cfg) - set(known))}; it takes {known}.") from err
