"""Guidance wrappers: out = bad + w (good - bad), for either objective: classifier-free guidance, TREAD's routing
guidance and SPRINT's path-drop guidance.

At fixed x and t, EDM's D and flow's v are affine in each other, so the same combination of network
outputs guides both. Every wrapper has the network's call shape (x, t, class_labels) and so they compose:
CFGDenoiser(RoutingGuidance(net, ...), w, null) applies CFG on top of routing guidance.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn


class CFGDenoiser(nn.Module):
    """Classifier-free guidance: out = out_u + w (out_c - out_u), with the null class as the unconditional label."""

    def __init__(self, net: nn.Module, guidance_scale: float, null_label: int):
        super().__init__()
        self.net, self.w, self.null_label = net, guidance_scale, null_label

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        if class_labels is None or self.w == 1.0:
            return self.net(x, sigma, class_labels)
        null = torch.full_like(class_labels, self.null_label)
        # One batched call for both branches: (2B, ...).
        D = self.net(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([class_labels, null]))
        D_c, D_u = D.chunk(2)
        return D_u + self.w * (D_c - D_u)


ForceRatio = Callable[[float], AbstractContextManager]


class RoutingGuidance(nn.Module):
    """TREAD's sample_tread / Sparse Guidance: out = D(gamma_2) + w (D(gamma_1) - D(gamma_2)), gamma_1 < gamma_2.

    The same network is evaluated twice with routing forced on at two selection ratios: the strong branch
    bypasses the fraction gamma_1 of the tokens, the weak (cheap) one gamma_2. `force_ratio(gamma)` is a
    context manager that forces routing at gamma, normally the backbone's `router.forced`; edm stays
    ignorant of routing and only calls it. A gamma of None evaluates that branch without forcing.

    Both branches are conditional (the Sparse Guidance paper's rule). `unconditional=True` gives both the
    null label instead (the released sample_tread, class_drop_prob=1). `bad_net` (with its own
    `bad_force_ratio`) replaces the weak branch by a second, weaker network, autoguidance-style.
    """

    def __init__(
        self,
        net: nn.Module,
        force_ratio: ForceRatio | None,
        gamma_1: float | None,
        gamma_2: float | None,
        w: float,
        *,
        unconditional: bool = False,
        null_label: int | None = None,
        bad_net: nn.Module | None = None,
        bad_force_ratio: ForceRatio | None = None,
    ):
        super().__init__()
        if bad_net is None and gamma_1 is not None and gamma_2 is not None and gamma_1 > gamma_2:
            raise ValueError(f"routing guidance needs gamma_1 <= gamma_2 (gamma_1 processes more tokens), got {gamma_1} > {gamma_2}.")
        if unconditional and null_label is None:
            raise ValueError("unconditional routing guidance needs null_label (the backbone's null class).")
        self.net, self.bad_net = net, bad_net if bad_net is not None else net
        self.force_ratio = force_ratio
        self.bad_force_ratio = bad_force_ratio if bad_net is not None else force_ratio
        self.gamma_1, self.gamma_2, self.w = gamma_1, gamma_2, w
        self.unconditional, self.null_label = unconditional, null_label

    def _branch(self, net, force_ratio, gamma, x, sigma, labels) -> torch.Tensor:
        context = nullcontext() if gamma is None or force_ratio is None else force_ratio(gamma)
        with context:
            return net(x, sigma, labels)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.unconditional:
            class_labels = torch.full((x.shape[0],), self.null_label, dtype=torch.long, device=x.device)
        good = self._branch(self.net, self.force_ratio, self.gamma_1, x, sigma, class_labels)
        # With w = 1 the weak branch cancels; with one network at one ratio the difference is zero in
        # expectation. Either way a single evaluation is the guided prediction, at half the cost.
        if self.w == 1.0 or (self.bad_net is self.net and self.gamma_1 == self.gamma_2):
            return good
        bad = self._branch(self.bad_net, self.bad_force_ratio, self.gamma_2, x, sigma, class_labels)
        return bad + self.w * (good - bad)


def with_routing_guidance(net: nn.Module, router, scale: float, gamma_1: float | None, gamma_2: float | None, *,
                          unconditional: bool = False, null_label: int | None = None,
                          bad_net: nn.Module | None = None, bad_router=None) -> nn.Module:
    """`net` itself when scale == 1 (guidance off), else `RoutingGuidance` forcing ratios through `router.forced`.

    `bad_net` (a weaker checkpoint) becomes the weak branch, forced at gamma_2 through its own `bad_router`.
    """
    if scale == 1.0:
        return net
    bad_force = bad_router.forced if bad_router is not None else None
    return RoutingGuidance(net, router.forced, gamma_1, gamma_2, scale, unconditional=unconditional, null_label=null_label,
                           bad_net=bad_net, bad_force_ratio=bad_force)


class PathDropGuidance(nn.Module):
    """SPRINT's Path-Drop Guidance: out = D_weak + w (D_full - D_weak).

    The guided branch is the full model with the class label; the weak branch has the null label and skips the
    sparse middle of every SPRINT route (mask tokens go into the fusion), so it costs only the dense encoder and
    decoder. It takes the place of CFG's unconditional branch at a fraction of its cost. `drop_paths()` is a
    context manager that makes the network skip those paths (the backbone's `router.path_dropped`); edm only
    calls it.
    """

    def __init__(self, net: nn.Module, drop_paths: Callable[[], AbstractContextManager], w: float, null_label: int):
        super().__init__()
        self.net, self.drop_paths, self.w, self.null_label = net, drop_paths, w, null_label

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        full = self.net(x, sigma, class_labels)
        null = torch.full((x.shape[0],), self.null_label, dtype=torch.long, device=x.device)
        with self.drop_paths():
            weak = self.net(x, sigma, null)
        return weak + self.w * (full - weak)


def with_path_drop_guidance(net: nn.Module, router, scale: float, null_label: int) -> nn.Module:
    """`net` itself when scale == 1 (off), else `PathDropGuidance` skipping paths through `router.path_dropped`.

    The context is entered once here, so a model without SPRINT routes is refused before any sampling."""
    if scale == 1.0:
        return net
    with router.path_dropped():
        pass
    return PathDropGuidance(net, router.path_dropped, scale, null_label)
