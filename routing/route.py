"""Route specs (TREAD's, and SPRINT's fusing kind), and their validation against a block stack."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from routing.errors import ConfigError


MODES = ("tread", "sprint")


@dataclass(frozen=True)
class Route:
    """Tokens picked by the policy skip blocks start..end (inclusive) and rejoin after end.

    `selection_ratio` is the fraction of tokens that BYPASS the route (TREAD's and SimpleTuner's name).
    mode "tread": the bypassing tokens rejoin unchanged; no parameters, and routing is off at inference.
    mode "sprint" (SPRINT's sparse-dense fusion): the bypassing positions get the backbone's fixed mask token,
    and a learned Linear(2D -> D) fuses that sequence with the route's start state. The fusion is part of the
    model, so it runs at inference too (with every token, ratio 0). `path_drop` is the per-sample probability,
    in training, of replacing the whole route output by mask tokens (SPRINT's path drop; 0 for tread).
    """

    selection_ratio: float
    start_layer_idx: int
    end_layer_idx: int
    mode: str = "tread"
    path_drop: float = 0.0


def resolve_routes(routes: Sequence[Mapping | Route], depth: int, fix: str = "") -> list[Route]:
    """Turn user route specs into validated routes with non-negative layer indices.

    Negative indices count from the end (-1 is the last block). Routes must be sorted, disjoint,
    in range, and have 0 <= selection_ratio < 1. `fix`: what the caller's user sets instead when a route's layers do
    not fit the `depth` blocks (where the routes came from, which key to set), in place of the generic advice.
    """
    resolved = []
    for k, spec in enumerate(routes):
        route = spec if isinstance(spec, Route) else _parse(spec, k)
        name = f"routing.routes[{k}] {_describe(route)}"
        if not 0.0 <= route.selection_ratio < 1.0:
            raise ConfigError(f"{name}: selection_ratio must be in [0, 1) (it is the fraction of tokens that bypass the route).")
        if route.mode not in MODES:
            raise ConfigError(f"{name}: mode must be one of {', '.join(MODES)} (sprint fuses the route's output with its start state).")
        if not 0.0 <= route.path_drop <= 1.0:
            raise ConfigError(f"{name}: path_drop must be in [0, 1] (the per-sample probability of dropping the route's output).")
        if route.path_drop and route.mode != "sprint":
            raise ConfigError(f"{name}: path_drop needs mode: sprint (a TREAD route has no mask token to drop to).")
        start = route.start_layer_idx + depth if route.start_layer_idx < 0 else route.start_layer_idx
        end = route.end_layer_idx + depth if route.end_layer_idx < 0 else route.end_layer_idx
        if not (0 <= start < depth and 0 <= end < depth):
            raise ConfigError(
                f"{name} resolves to layers {start}..{end}, outside the model's {depth} blocks; "
                f"{fix or f'use indices in [-{depth}, {depth - 1}]'}."
            )
        if start > end:
            raise ConfigError(f"{name} resolves to start {start} > end {end} on the model's {depth} blocks; "
                              f"{fix or 'the end index is inclusive and must not precede the start'}.")
        if resolved and start <= resolved[-1].end_layer_idx:
            raise ConfigError(
                f"{name} resolves to layers {start}..{end}, which overlaps or precedes the previous route "
                f"(ending at {resolved[-1].end_layer_idx}); routes must be sorted and disjoint."
            )
        resolved.append(Route(float(route.selection_ratio), start, end, route.mode, float(route.path_drop)))
    return resolved


REQUIRED = ("selection_ratio", "start_layer_idx", "end_layer_idx")
OPTIONAL = ("mode", "path_drop")


def _parse(spec: Mapping, k: int) -> Route:
    if not isinstance(spec, Mapping):
        raise ConfigError(f"routing.routes[{k}]={spec!r} must be a mapping such as "
                          "{selection_ratio: 0.5, start_layer_idx: 2, end_layer_idx: -4}.")
    missing, unknown = set(REQUIRED) - set(spec), set(spec) - set(REQUIRED) - set(OPTIONAL)
    if missing or unknown:
        raise ConfigError(
            f"routing.routes[{k}] must have the keys {', '.join(REQUIRED)} and may have {', '.join(OPTIONAL)} "
            f"(missing: {sorted(missing)}, unknown: {sorted(unknown)})."
        )
    numbers = {"selection_ratio": float, "start_layer_idx": int, "end_layer_idx": int, "path_drop": float}
    for key, kind in numbers.items():
        value = spec.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ConfigError(f"routing.routes[{k}].{key}={value!r} must be {'a whole number' if kind is int else 'a number'}.")
    return Route(float(spec["selection_ratio"]), int(spec["start_layer_idx"]), int(spec["end_layer_idx"]),
                 str(spec.get("mode", "tread")), float(spec.get("path_drop", 0.0)))


def _describe(route: Route) -> str:
    extra = f", mode: {route.mode}, path_drop: {route.path_drop}" if route.mode != "tread" else ""
    return (f"{{selection_ratio: {route.selection_ratio}, start_layer_idx: {route.start_layer_idx}, "
            f"end_layer_idx: {route.end_layer_idx}{extra}}}")
