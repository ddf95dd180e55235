"""The block runner every backbone uses; applies TREAD and SPRINT routes over any block stack.

At a route start the full sequence is kept aside and the policy's subset is gathered; blocks
start..end run on the subset only; at the route end the processed tokens are scattered back:
- TREAD: into the kept-aside sequence, out of place, so bypassing tokens rejoin unchanged and gradients reach all;
- SPRINT: into a sequence of the backbone's mask token, which a learned fusion then mixes with the kept-aside
  start state (the dense-shallow path) before the remaining blocks run on every token.
The fusion layers and mask tokens are the backbone's (`fusions`, keyed by the route's start layer): the router
holds no parameters and imports no model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from routing.errors import ConfigError
from routing.policy import Drawn, ForceKeep, Grid, NoRouting, RoutingPolicy, uniform_scores
from routing.route import Route


class Fusion(Protocol):
    """What a SPRINT route needs from its backbone: a fixed mask token and the fusion of the two paths."""

    mask_token: torch.Tensor  # (1, 1, D), not trained

    def __call__(self, middle: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """(B, N, D) route output with mask tokens at bypassing positions, (B, N, D) start state -> (B, N, D)."""


class Router:
    def __init__(
        self,
        policy: RoutingPolicy | None = None,
        routes: Sequence[Route] = (),
        *,
        force: bool = False,
        fp32_after_route: bool = False,
        checkpointing: bool = False,
    ):
        self.policy = policy or NoRouting()
        self.routes = list(routes)
        self.force = force  # route in eval mode too (experiments); TREAD routes only while training
        self.fp32_after_route = fp32_after_route
        # Gradient checkpointing: each block's activations are recomputed in the backward pass instead of kept.
        self.checkpointing = checkpointing
        # Each block a nested compile region under torch.compile (set by trainer.compile_regions): traced and compiled
        # once per distinct input, then reused by every block like it. A no-op in eager mode.
        self.regions = False
        # Draws of forwards outside training (sampling, routed guidance, adapters' callers); training uses set_draws.
        self.generator: torch.Generator | None = None
        # The sequence length the routes see (set by the backbone), so that set_draws can draw before the forward.
        self.tokens: int | None = None
        self._draw_spec: tuple[torch.Generator, int, int] | None = None  # (generator at its set_draws state, start, total)
        self._drawn: torch.Tensor | None = None  # (total, routes, tokens + 1), rolled so this micro-batch's rows come first
        self.last_masks: list[torch.Tensor] = []  # per route, (B, N) bool of processed tokens
        self._unforced_routes: list[Route] | None = None  # the trained routes while `forced` is active
        self.drop_paths = False  # SPRINT routes skip their blocks and feed only mask tokens (Path-Drop Guidance)

    def set_draws(self, generator: torch.Generator | None, start: int = 0, total: int | None = None) -> None:
        """Draw the routes of the next training forwards as rows start..start+b of the global batch's draws.

        generator: seeded only by (seed, step), on the training device; total: the global batch size; start: this
        micro-batch's offset in it. Every route draw (a policy's uniform scores, SPRINT's path drop) then comes from
        one (total, routes, tokens + 1) uniform tensor, row i for sample i: a sample's route depends on (seed, step,
        sample index) only, so 1 process, N processes and any grad_accum train the same routes. The draw happens
        here when the backbone set `tokens` (outside a compiled or captured forward), else at the first forward.
        The generator's state is copied, so the caller may pass one generator to every micro-batch of a step.
        None returns training forwards to `generator` (per-forward draws).
        """
        if generator is None:
            self._draw_spec, self._drawn = None, None
            return
        total = int(total) if total is not None else None
        if total is None or not 0 <= start < total:
            raise ValueError(f"set_draws needs 0 <= start < total (the micro-batch's offset in the global batch), got start={start}, total={total}.")
        own = torch.Generator(device=generator.device)
        own.set_state(generator.get_state())
        self._draw_spec, self._drawn = (own, int(start), total), None
        if self.tokens is not None:
            self._drawn = self._draw(self.tokens)

    def _draw(self, tokens: int) -> torch.Tensor:
        """(total, routes, tokens + 1) uniform draws, rolled so that this micro-batch's rows come first: columns
        [:tokens] are a route's token scores, the last its path-drop draw. The roll, not a slice, keeps one shape for
        every micro-batch (a compiled forward takes rows [:b] and never specializes on `start`)."""
        generator, start, total = self._draw_spec
        replay = torch.Generator(device=generator.device)
        replay.set_state(generator.get_state())  # every draw of one set_draws gives the same tensor
        u = torch.rand(total, max(len(self.routes), 1), tokens + 1, generator=replay, device=generator.device)
        return u.roll(-start, 0)

    def _route_draws(self, position: int, x: torch.Tensor, training: bool) -> tuple[torch.Generator | Drawn | None, torch.Tensor | None]:
        """(what the policy draws from, (B, 1) path-drop uniforms or None) for the route at `position` in `routes`."""
        if self._draw_spec is None or not training:
            return self.generator, None
        b, n, _ = x.shape
        if self._drawn is None or self._drawn.shape[-1] != n + 1:
            self._drawn = self._draw(n)  # tokens unknown or changed (bucketed data): drawn here, eagerly
        if not torch.compiler.is_compiling():
            _, start, total = self._draw_spec
            if start + b > total:
                raise ValueError(f"a micro-batch of {b} at offset {start} exceeds the global batch of {total} given to set_draws.")
        rows = self._drawn[:b, position].to(x.device)  # (total, routes, N + 1) -> (B, N + 1)
        return Drawn(rows[:, :n]), rows[:, n:]

    @property
    def fuses(self) -> bool:
        """True when a route is SPRINT's fusing kind, whose fusion layer is part of the model."""
        trained = self._unforced_routes if self._unforced_routes is not None else self.routes
        return any(r.mode == "sprint" for r in trained)

    @contextmanager
    def forced(self, selection_ratio: float) -> Iterator[Router]:
        """Route in eval mode too, with every route's selection_ratio replaced by `selection_ratio`.

        Routed inference (TREAD): a model trained with routing is evaluated at ratios it may never have
        seen, which cuts FLOPs and gives routing guidance its weak branch. Ratio 0 runs no TREAD route at all,
        so it is exactly the unrouted network; a SPRINT route stays, with every token, because its fusion is
        part of the model. The routes and `force` are restored on exit.
        """
        if not 0.0 <= selection_ratio < 1.0:
            raise ConfigError(f"route ratio {selection_ratio} must be in [0, 1) (the fraction of tokens that bypass each route).")
        trained = self._unforced_routes if self._unforced_routes is not None else self.routes
        if selection_ratio > 0 and not trained:
            raise ConfigError(
                f"route ratio {selection_ratio} needs routes to force, but this model has none (it was trained without "
                "routing); routed inference and routing guidance need a model trained with routes (e.g. routing=random), "
                "so sample this one without them."
            )
        saved = self.routes, self.force, self._unforced_routes
        # Nested calls (a guidance branch inside a FLOPs count) start from the trained routes again.
        self._unforced_routes = trained
        self.routes = [replace(r, selection_ratio=float(selection_ratio)) for r in trained
                       if selection_ratio > 0 or r.mode == "sprint"]
        self.force = True
        try:
            yield self
        finally:
            self.routes, self.force, self._unforced_routes = saved

    @contextmanager
    def path_dropped(self) -> Iterator[Router]:
        """SPRINT routes skip their blocks: the fusion sees mask tokens and the start state only (the weak branch of
        Path-Drop Guidance, which costs the dense encoder and decoder only)."""
        if not self.fuses:
            raise ConfigError("path-drop guidance needs a SPRINT model (a route with mode: sprint, e.g. routing=sprint); "
                              "this model has none; guide it with --guidance (CFG) or --rg-scale.")
        saved, self.drop_paths = self.drop_paths, True
        try:
            yield self
        finally:
            self.drop_paths = saved

    def active_routes(self, training: bool) -> dict[int, Route]:
        """Routes that run in this forward, by start layer: TREAD routes while training (or forced); SPRINT routes
        always, with every token (ratio 0) where TREAD's would be off."""
        routed = training or self.force
        return {r.start_layer_idx: r if routed else replace(r, selection_ratio=0.0)
                for r in self.routes if routed or r.mode == "sprint"}

    def run(
        self, blocks: nn.ModuleList, x: torch.Tensor, c: torch.Tensor, grid: Grid, training: bool,
        force_keep: torch.Tensor | ForceKeep | None = None, fusions: Mapping[str, Fusion] | None = None,
    ) -> torch.Tensor:
        """x: (B, N, D) tokens in raster order on `grid`; c: (B, D). Returns (B, N, D).

        force_keep: (B, N) bool, tokens every route processes (e.g. a masked-loss region); see routing.policy. As a
        ForceKeep (the trainer's masks) it carries its host copy, and no route reads the device for its size.
        fusions: the backbone's fusion of each SPRINT route, by str(start_layer_idx).
        """
        self.last_masks = []
        routes = self.active_routes(training)
        i, depth, position = 0, len(blocks), 0
        while i < depth:
            route = routes.get(i)
            if route is None:
                x = self._block(blocks[i], x, c, grid)
                i += 1
                continue
            draws = self._route_draws(position, x, training)
            position += 1
            if route.mode == "sprint":
                key = str(route.start_layer_idx)
                fusion = fusions[key] if fusions is not None and key in fusions else None
                if fusion is None:
                    raise ConfigError(f"route r{route.start_layer_idx}->{route.end_layer_idx} is a SPRINT route, but the model has no "
                                      "fusion layer for it; only the backbones (dit, rwkv, mamba, diffmoe) train SPRINT routes.")
                x = self._run_fusing_route(blocks, route, x, c, grid, force_keep, fusion, training, draws)
            else:
                x = self._run_route(blocks, route, x, c, grid, force_keep, draws)
            i = route.end_layer_idx + 1
            if self.fp32_after_route and i < depth:
                # TREAD's note: under bf16 the first block after a route can be unstable; run it in fp32.
                with torch.autocast(device_type=x.device.type, enabled=False):
                    x = self._block(blocks[i], x.float(), c.float(), grid)
                i += 1
        return x

    def _block(self, block, x, c, grid):
        """block(x, c, grid); under gradient checkpointing, recomputed in the backward pass (one wrapper for every
        block of every stack, routed or not)."""
        # A hooked block (an aligned layer's capture) runs inline: a region's body must have no side effects.
        run = _call_region if self.regions and not (block._forward_hooks or block._forward_pre_hooks) else _call
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(run, block, x, c, grid, use_reentrant=False)
        return run(block, x, c, grid)

    def _run_route(self, blocks, route: Route, x, c, grid, force_keep=None, draws=(None, None)):
        index, x_sub = self._gather_and_run(blocks, route, x, c, grid, force_keep, draws[0])
        # Out of place: `x` itself stays in the autograd graph, so bypassing tokens get gradients too.
        return x.scatter(1, index, x_sub.to(x.dtype))

    def _gather_and_run(self, blocks, route: Route, x, c, grid, force_keep=None, source=None):
        """The policy's subset of x through blocks start..end: (index (B, K, D), processed subset (B, K, D)).
        source: what the policy draws from (a generator, or this route's scores from set_draws)."""
        # Policies written before force-keep masks existed keep working when no mask is given.
        extra = {} if force_keep is None else {"force_keep": force_keep}
        sel = self.policy.select(x, grid, route.selection_ratio, source, **extra)
        b, n, d = x.shape
        index = sel.indices[:, :, None].expand(-1, -1, d)  # (B, K) -> (B, K, D)
        x_sub = x.gather(1, index)  # (B, K, D)
        for j in range(route.start_layer_idx, route.end_layer_idx + 1):
            x_sub = self._block(blocks[j], x_sub, c, sel.grid)
        mask = torch.zeros(b, n, dtype=torch.bool, device=x.device).scatter_(1, sel.indices, True)
        self.last_masks.append(mask)
        return index, x_sub

    def _run_fusing_route(self, blocks, route: Route, x, c, grid, force_keep, fusion: Fusion, training: bool, draws=(None, None)):
        """SPRINT: the start state x is the dense-shallow path; the route's output, with the mask token at every
        bypassing position, is the sparse-deep path; fusion(deep, shallow) goes on to the dense decoder."""
        b, n, d = x.shape
        mask_tokens = fusion.mask_token.to(x.dtype).expand(b, n, d)  # (1, 1, D) -> (B, N, D)
        if self.drop_paths:
            self.last_masks.append(torch.zeros(b, n, dtype=torch.bool, device=x.device))
            return fusion(mask_tokens, x)
        if route.selection_ratio > 0:
            index, x_sub = self._gather_and_run(blocks, route, x, c, grid, force_keep, draws[0])
            deep = mask_tokens.scatter(1, index, x_sub.to(x.dtype))
        else:  # every token (inference, or SPRINT's full-token second stage): no gather, no scatter
            deep = x
            for j in range(route.start_layer_idx, route.end_layer_idx + 1):
                deep = self._block(blocks[j], deep, c, grid)
            self.last_masks.append(torch.ones(b, n, dtype=torch.bool, device=x.device))
        if training and route.path_drop > 0:
            # Path drop: the whole deep path of a sample becomes mask tokens, so the decoder also learns the
            # shallow-only prediction that Path-Drop Guidance uses as its weak branch.
            u = draws[1] if draws[1] is not None else uniform_scores(b, 1, draws[0], x.device)  # (B, 1)
            dropped = u[:, :, None] < route.path_drop  # (B, 1) -> (B, 1, 1)
            deep = torch.where(dropped, mask_tokens, deep.to(x.dtype))
        return fusion(deep.to(x.dtype), x)


def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# PyTorch's counter knows the CUDA attention kernels but not the CPU kernel SDPA dispatches to, so on a CPU
# attention counted as zero; that kernel does the same two matmuls, so it gets the same formulas.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


def count_flops(fn: Callable[[], object], grad: bool = False) -> int:
    """FLOPs of one call of `fn` as torch.utils.flop_counter sees them: matmuls, convolutions and attention, on
    every device (the CPU attention kernel gets the CUDA kernels' formulas). Element-wise work and custom scans
    (Bi-WKV cumulative sums, selective scans) are not counted. grad=False runs `fn` under no_grad (inference);
    a training step that calls backward needs grad=True."""
    with torch.set_grad_enabled(grad), FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        fn()
    return counter.get_total_flops()


def routed_flops(fn: Callable[[], object], router: Router, selection_ratio: float) -> tuple[int, int]:
    """(routed, unrouted) FLOPs of one network evaluation `fn()`, routing forced at `selection_ratio` vs off."""
    with router.forced(selection_ratio):
        routed = count_flops(fn)
    with router.forced(0.0):
        unrouted = count_flops(fn)
    return routed, unrouted


def _call(block, x, c, grid):
    return block(x, c, grid)


# torch >= 2.8 (hierarchical compilation); trainer.compile_regions refuses older versions (train/compiling.py).
_call_region = torch.compiler.nested_compile_region(_call) if hasattr(torch.compiler, "nested_compile_region") else _call
