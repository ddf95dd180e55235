"""Seeded sampling of a trained network: the one entry point for previews, `train.sample`, FID and the bench."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from edm.guidance import CFGDenoiser
from edm.objectives import EDM, Objective


@torch.no_grad()
def generate(net, labels: torch.Tensor, *, shape, steps: int, guidance: float, seed: int, device, sampler: str = "heun",
             null_label: int | None = None, progress: bool = False, objective: Objective | None = None,
             router=None, route_ratio: float = 0.0) -> torch.Tensor:
    """Samples in model space (n, C, H, W) for `labels`; the same seed gives the same samples at every call.

    `net` is the objective's wrapped network (or a guidance wrapper around it); `objective` defaults to EDM.
    `router`, any object with a `generator` attribute (the backbone's Router), gets a generator seeded from
    `seed` for the duration of the call, so routed inference and routing guidance repeat too.
    `route_ratio` > 0 forces routing at that selection ratio over the trained routes (routed inference,
    cheaper per evaluation) through `router.forced`.
    """
    objective = objective if objective is not None else EDM()
    if sampler not in objective.samplers:
        raise ValueError(f"sampler='{sampler}' is unknown for objective={objective.name}; choose one of {sorted(objective.samplers)}.")
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(labels), *shape, generator=generator).to(device)
    # Routing draws from its own stream, derived from the seed after the noise, so the noise is the same
    # with and without routing.
    routing_seed = int(torch.randint(2**62, (1,), generator=generator))
    grid = objective.time_grid(steps, device=device)
    # Guidance needs the null class; without one (or with w = 1) the plain conditional model is used.
    denoiser = CFGDenoiser(net, guidance, null_label) if null_label is not None else net
    if route_ratio and router is None:
        raise ValueError("route_ratio needs the router of the sampled network (router=backbone.router).")
    saved = router.generator if router is not None else None
    if router is not None:
        router.generator = torch.Generator().manual_seed(routing_seed)
    forced = router.forced(route_ratio) if route_ratio else nullcontext()
    try:
        with forced:
            x = objective.samplers[sampler](denoiser, noise * grid[0], grid, extra_args={"class_labels": labels.to(device)},
                                            disable=not progress)
    finally:
        if router is not None:
            router.generator = saved
    return x.float()
