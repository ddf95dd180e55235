"""Hidden states after chosen blocks of a `Backbone`, with the token positions each one holds.

Representation alignment (REPA, SRA) reads the residual stream after block l. Every family runs its blocks
through the shared `Router`, so one forward hook on `backbone.blocks[l]` captures that state for DiT, RWKV,
Mamba and DiffMoE alike, with nothing changed in the skeleton. Inside a route the block sees only the
route's tokens, in the policy's processing order (raster order, or group by group for `structured`); the
router keeps only a mask of them, so the policy is wrapped to remember its last selection, which is exactly
the order of the subset the route's blocks run on.

Which tokens a captured state holds (docs/alignment.md):
- outside every route, and in SPRINT's dense encoder and decoder: all N tokens, in raster order;
- inside a TREAD route, or the sparse middle of a SPRINT route: the route's kept tokens only;
- inside a SPRINT route run with every token (inference, the second stage, ratio 0): all N, raster order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial

import torch
from torch import nn

from routing.errors import ConfigError
from routing.route import Route


class EnoughCaptured(Exception):
    """Raised by a capture with `stop_after` once that block's state is held: the rest of the forward is skipped
    (a teacher needs no block after its own)."""


class RecordingPolicy:
    """A routing policy that remembers its last selection; everything else is the wrapped policy's."""

    def __init__(self, inner):
        self.inner = inner
        self.last = None  # the last Selection: indices (B, K) in the order the route's blocks see its tokens

    def select(self, x, grid, selection_ratio, generator, **kwargs):
        self.last = self.inner.select(x, grid, selection_ratio, generator, **kwargs)
        return self.last

    def __getattr__(self, name):
        if name in ("inner", "last"):  # not yet set (copy and pickle build the object without __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)


def block_index(index: int, depth: int, key: str = "align.layer") -> int:
    """A block index of the config (negative counts from the end) as 0..depth-1; ConfigError outside the stack."""
    resolved = index + depth if index < 0 else index
    if not 0 <= resolved < depth:
        raise ConfigError(f"{key}={index} is outside the model's {depth} blocks; use an index in [-{depth}, {depth - 1}].")
    return resolved


def span_of(routes: Iterable[Route], layer: int) -> Route | None:
    """The route whose blocks start..end hold `layer`, or None when the block runs outside every route."""
    return next((r for r in routes if r.start_layer_idx <= layer <= r.end_layer_idx), None)


def _where(route: Route | None) -> str:
    return "outside every route" if route is None else f"in route r{route.start_layer_idx}->{route.end_layer_idx}"


def check_layers(routes: Sequence[Route], depth: int, layer: int, teacher_layer: int | None = None,
                 teacher: str | None = None) -> tuple[int, int | None]:
    """The aligned block (and the self-alignment teacher's block) as indices 0..depth-1, or ConfigError.

    Every block can be aligned: inside a route its kept tokens, outside the full sequence. The one span a state
    cannot be read from is an online teacher's: a teacher block inside a route holds that route's tokens only,
    so the student must sit in the same route (then both hold the same tokens, in the same order). The EMA
    teacher runs with every token (routes forced to ratio 0), so it sees every position.
    """
    student = block_index(layer, depth)
    if teacher_layer is None:
        return student, None
    target = block_index(teacher_layer, depth, "align.teacher_layer")
    if target <= student:
        raise ConfigError(f"align.teacher_layer={teacher_layer} (block {target}) is not after align.layer={layer} (block {student}); "
                          "self-alignment aligns an earlier block with a later one (SRA: block 8 with block 20 of 28).")
    inside, own = span_of(routes, target), span_of(routes, student)
    sees_all = inside is None or (inside.mode == "sprint" and inside.selection_ratio == 0)  # SPRINT's full-token stage
    if teacher == "online" and not sees_all and inside != own:
        raise ConfigError(f"align.teacher_layer={teacher_layer} (block {target}) lies in route r{inside.start_layer_idx}->"
                          f"{inside.end_layer_idx}, which holds only its kept tokens, but align.layer={layer} (block {student}) is "
                          f"{_where(own)}, so the online teacher cannot see every token the student aligns; move the teacher "
                          f"block past {inside.end_layer_idx}, put both blocks in that route, or use align.teacher=ema.")
    return student, target


class HiddenCapture:
    """Forward hooks that keep the state after each block in `layers` (0..depth-1) and the positions it holds.

    After a forward of `backbone`: `hidden[l]` is the (B, K, D) output of block l, with its autograd graph;
    `positions[l]` is (B, K) int64, the raster index of each of its tokens, or None when it holds all N in
    raster order. A new forward starts empty; a second run of a block in the same forward (the recompute of
    gradient checkpointing in the backward pass) leaves the first capture in place.
    """

    def __init__(self, backbone: nn.Module, layers: Iterable[int]):
        self.backbone = backbone
        self.layers = sorted({block_index(l, backbone.depth) for l in layers})
        self.hidden: dict[int, torch.Tensor] = {}
        self.positions: dict[int, torch.Tensor | None] = {}
        self.stop_after: int | None = None
        self._handles: list = []
        self.attach()

    def attach(self) -> None:
        if self._handles:
            return
        # The policy is wrapped now, before any compiled forward: a swap inside the first one would fail the compiled
        # graph's guard on the policy's type at the next step and recompile the whole model.
        self._record_policy()
        self._handles.append(self.backbone.register_forward_pre_hook(self._start))
        self._handles += [self.backbone.blocks[l].register_forward_hook(partial(self._store, l)) for l in self.layers]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        router = self.backbone.router
        if isinstance(router.policy, RecordingPolicy):
            router.policy = router.policy.inner

    def __deepcopy__(self, memo) -> HiddenCapture:
        # A deep copy of the hooked backbone (the EMA, built by copying the network) copies the hooks, which point
        # here; they see modules that are not this backbone's and do nothing, so the copy captures nothing.
        return self

    def clear(self) -> None:
        self.hidden.clear()
        self.positions.clear()

    def _start(self, module, args) -> None:
        if module is not self.backbone:
            return
        self.clear()
        self._record_policy()  # a router attached after this capture is wrapped at its first forward

    def _record_policy(self) -> None:
        router = self.backbone.router
        if not isinstance(router.policy, RecordingPolicy):
            router.policy = RecordingPolicy(router.policy)

    def _store(self, layer: int, module, args, output) -> None:
        if layer in self.hidden or module is not self.backbone.blocks[layer]:
            return
        router = self.backbone.router
        route = span_of(router.active_routes(self.backbone.training).values(), layer)
        held = None
        # A TREAD route always runs the policy's selection (at ratio 0 too, in its order); a SPRINT route at ratio 0
        # runs every token without one.
        if route is not None and (route.mode != "sprint" or route.selection_ratio > 0):
            held = router.policy.last.indices
            if held.shape[:2] != output.shape[:2]:
                raise RuntimeError(f"block {layer} returned {tuple(output.shape)}, but its route selected {tuple(held.shape)} tokens.")
        self.hidden[layer], self.positions[layer] = output, held
        if self.stop_after == layer:
            raise EnoughCaptured
