"""The block runner every backbone uses; applies TREAD routes over any block stack.

At a route start the full sequence is kept aside and the policy's subset is gathered; blocks
start..end run on the subset only; at the route end the processed tokens are scattered back into
the kept-aside sequence out of place, so bypassing tokens rejoin unchanged and gradients reach all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from routing.errors import ConfigError
from routing.policy import Grid, NoRouting, RoutingPolicy
from routing.route import Route


class Router:
    def __init__(
        self,
        policy: RoutingPolicy | None = None,
        routes: Sequence[Route] = (),
        *,
        force: bool = False,
        fp32_after_route: bool = False,
    ):
        self.policy = policy or NoRouting()
        self.routes = list(routes)
        self.force = force  # route in eval mode too (experiments); TREAD routes only while training
        self.fp32_after_route = fp32_after_route
        self.generator: torch.Generator | None = None  # set by the trainer: per-rank, per-step seeded
        self.last_masks: list[torch.Tensor] = []  # per route, (B, N) bool of processed tokens
        self._unforced_routes: list[Route] | None = None  # the trained routes while `forced` is active

    @contextmanager
    def forced(self, selection_ratio: float) -> Iterator[Router]:
        """Route in eval mode too, with every route's selection_ratio replaced by `selection_ratio`.

        Routed inference (TREAD): a model trained with routing is evaluated at ratios it may never have
        seen, which cuts FLOPs and gives routing guidance its weak branch. Ratio 0 runs no route at all,
        so it is exactly the unrouted network. The routes and `force` are restored on exit.
        """
        if not 0.0 <= selection_ratio < 1.0:
            raise ConfigError(f"route ratio {selection_ratio} must be in [0, 1) (the fraction of tokens that bypass each route).")
        trained = self._unforced_routes if self._unforced_routes is not None else self.routes
        if selection_ratio > 0 and not trained:
            raise ConfigError(
                f"route ratio {selection_ratio} needs routes to force, but this model has none; "
                "give the routes it was trained with (routing=random or routing.routes=...)."
            )
        saved = self.routes, self.force, self._unforced_routes
        # Nested calls (a guidance branch inside a FLOPs count) start from the trained routes again.
        self._unforced_routes = trained
        self.routes = [replace(r, selection_ratio=float(selection_ratio)) for r in trained] if selection_ratio > 0 else []
        self.force = True
        try:
            yield self
        finally:
            self.routes, self.force, self._unforced_routes = saved

    def run(
        self, blocks: nn.ModuleList, x: torch.Tensor, c: torch.Tensor, grid: Grid, training: bool,
        force_keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, N, D) tokens in raster order on `grid`; c: (B, D). Returns (B, N, D).

        force_keep: (B, N) bool, tokens every route processes (e.g. a masked-loss region); see routing.policy.
        """
        self.last_masks = []
        routes = {r.start_layer_idx: r for r in self.routes} if (training or self.force) else {}
        i, depth = 0, len(blocks)
        while i < depth:
            route = routes.get(i)
            if route is None:
                x = blocks[i](x, c, grid)
                i += 1
                continue
            x = self._run_route(blocks, route, x, c, grid, force_keep)
            i = route.end_layer_idx + 1
            if self.fp32_after_route and i < depth:
                # TREAD's note: under bf16 the first block after a route can be unstable; run it in fp32.
                with torch.autocast(device_type=x.device.type, enabled=False):
                    x = blocks[i](x.float(), c.float(), grid)
                i += 1
        return x

    def _run_route(self, blocks, route: Route, x, c, grid, force_keep=None):
        # Policies written before force-keep masks existed keep working when no mask is given.
        extra = {} if force_keep is None else {"force_keep": force_keep}
        sel = self.policy.select(x, grid, route.selection_ratio, self.generator, **extra)
        b, n, d = x.shape
        index = sel.indices[:, :, None].expand(-1, -1, d)  # (B, K) -> (B, K, D)
        x_sub = x.gather(1, index)  # (B, K, D)
        for j in range(route.start_layer_idx, route.end_layer_idx + 1):
            x_sub = blocks[j](x_sub, c, sel.grid)
        mask = torch.zeros(b, n, dtype=torch.bool, device=x.device).scatter_(1, sel.indices, True)
        self.last_masks.append(mask)
        # Out of place: `x` itself stays in the autograd graph, so bypassing tokens get gradients too.
        return x.scatter(1, index, x_sub.to(x.dtype))


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of one call of `fn` (torch.utils.flop_counter: matmuls, convolutions and attention)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def routed_flops(fn: Callable[[], object], router: Router, selection_ratio: float) -> tuple[int, int]:
    """(routed, unrouted) FLOPs of one network evaluation `fn()`, routing forced at `selection_ratio` vs off."""
    with router.forced(selection_ratio):
        routed = count_flops(fn)
    with router.forced(0.0):
        unrouted = count_flops(fn)
    return routed, unrouted
