"""Route specs with TREAD semantics, and their validation against a block stack."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from routing.errors import ConfigError


@dataclass(frozen=True)
class Route:
    """Tokens picked by the policy skip blocks start..end (inclusive) and rejoin unchanged after end.

    `selection_ratio` is the fraction of tokens that BYPASS the route (TREAD's and SimpleTuner's name).
    """

    selection_ratio: float
    start_layer_idx: int
    end_layer_idx: int


def resolve_routes(routes: Sequence[Mapping | Route], depth: int) -> list[Route]:
    """Turn user route specs into validated routes with non-negative layer indices.

    Negative indices count from the end (-1 is the last block). Routes must be sorted, disjoint,
    in range, and have 0 <= selection_ratio < 1.
    """
    resolved = []
    for k, spec in enumerate(routes):
        route = spec if isinstance(spec, Route) else _parse(spec, k)
        name = f"routing.routes[{k}] {_describe(route)}"
        if not 0.0 <= route.selection_ratio < 1.0:
            raise ConfigError(f"{name}: selection_ratio must be in [0, 1) (it is the fraction of tokens that bypass the route).")
        start = route.start_layer_idx + depth if route.start_layer_idx < 0 else route.start_layer_idx
        end = route.end_layer_idx + depth if route.end_layer_idx < 0 else route.end_layer_idx
        if not (0 <= start < depth and 0 <= end < depth):
            raise ConfigError(
                f"{name} resolves to layers {start}..{end}, outside the model's {depth} blocks; "
                f"use indices in [-{depth}, {depth - 1}]."
            )
        if start > end:
            raise ConfigError(f"{name} resolves to start {start} > end {end}; the end index is inclusive and must not precede the start.")
        if resolved and start <= resolved[-1].end_layer_idx:
            raise ConfigError(
                f"{name} resolves to layers {start}..{end}, which overlaps or precedes the previous route "
                f"(ending at {resolved[-1].end_layer_idx}); routes must be sorted and disjoint."
            )
        resolved.append(Route(float(route.selection_ratio), start, end))
    return resolved


def _parse(spec: Mapping, k: int) -> Route:
    keys = {"selection_ratio", "start_layer_idx", "end_layer_idx"}
    missing, unknown = keys - set(spec), set(spec) - keys
    if missing or unknown:
        raise ConfigError(
            f"routing.routes[{k}] must have exactly the keys selection_ratio, start_layer_idx, end_layer_idx "
            f"(missing: {sorted(missing)}, unknown: {sorted(unknown)})."
        )
    return Route(float(spec["selection_ratio"]), int(spec["start_layer_idx"]), int(spec["end_layer_idx"]))


def _describe(route: Route) -> str:
    return f"{{selection_ratio: {route.selection_ratio}, start_layer_idx: {route.start_layer_idx}, end_layer_idx: {route.end_layer_idx}}}"
