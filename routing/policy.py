"""RoutingPolicy: which tokens a route processes.

A policy sees the token tensor and its grid and returns the sorted indices of the tokens that run
through the route (so raster order is kept) and, when the subset is itself a grid, that grid.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from routing.errors import ConfigError

Grid = tuple[int, int]


@dataclass
class Selection:
    indices: torch.Tensor  # (B, K) int64, sorted ascending per sample
    grid: Grid | None  # (h_keep, w) when the processed tokens form a grid, else None


class RoutingPolicy(ABC):
    """Chooses the processed subset of a route; `selection_ratio` is the fraction that bypasses."""

    name: str
    yields_grid: bool  # True if `select` keeps a 2-D grid, which scan-order blocks need

    def num_processed(self, grid: Grid, selection_ratio: float) -> int:
        """Number of tokens a route processes: floor(N * (1 - ratio)), as TREAD counts the kept tokens."""
        return kept(grid[0] * grid[1], selection_ratio)

    def check(self, grid: Grid, selection_ratio: float) -> None:
        """Raise ConfigError if this ratio leaves nothing to process on this grid."""
        if self.num_processed(grid, selection_ratio) < 1:
            raise ConfigError(
                f"routing policy '{self.name}' with selection_ratio={selection_ratio} on a {grid[0]}x{grid[1]} token grid "
                "leaves no token to process; lower selection_ratio."
            )

    @abstractmethod
    def select(self, x: torch.Tensor, grid: Grid, selection_ratio: float, generator: torch.Generator | None) -> Selection:
        """x: (B, N, D) tokens in raster order on `grid`."""


def kept(n: int, selection_ratio: float) -> int:
    # The epsilon stops float error from flooring 100 * (1 - 0.9) = 9.999... down to 9.
    return int(n * (1.0 - selection_ratio) + 1e-9)


def uniform_scores(b: int, n: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """(B, N) uniform scores drawn on the CPU, so a seed picks the same tokens on any device."""
    return torch.rand(b, n, generator=generator).to(device)


def random_subset(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row indices of the k largest scores, sorted ascending: (B, N) -> (B, k)."""
    return scores.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


class NoRouting(RoutingPolicy):
    """Every token is processed: the control condition."""

    name, yields_grid = "none", True

    def num_processed(self, grid: Grid, selection_ratio: float) -> int:
        return grid[0] * grid[1]

    def select(self, x, grid, selection_ratio, generator):
        b, n, _ = x.shape
        return Selection(torch.arange(n, device=x.device).expand(b, n), grid)


class RandomRouting(RoutingPolicy):
    """Uniform random subset per sample (TREAD's choice for attention); the subset has no grid."""

    name, yields_grid = "random", False

    def select(self, x, grid, selection_ratio, generator):
        b, n, _ = x.shape
        scores = uniform_scores(b, n, generator, x.device)
        return Selection(random_subset(scores, self.num_processed(grid, selection_ratio)), None)


class RowRouting(RoutingPolicy):
    """A random subset of whole rows per sample.

    Kept rows stay complete and in order, so the subset is an (h_keep, w) grid in which a row scan or a
    token shift still sees true left/right neighbours; this is what scan-order models (RWKV, Mamba) need.
    """

    name, yields_grid = "rows", True

    def rows_processed(self, grid: Grid, selection_ratio: float) -> int:
        return kept(grid[0], selection_ratio)

    def num_processed(self, grid: Grid, selection_ratio: float) -> int:
        return self.rows_processed(grid, selection_ratio) * grid[1]

    def select(self, x, grid, selection_ratio, generator):
        h, w = grid
        b = x.shape[0]
        h_keep = self.rows_processed(grid, selection_ratio)
        rows = random_subset(uniform_scores(b, h, generator, x.device), h_keep)  # (B, h_keep)
        cols = torch.arange(w, device=x.device)
        indices = (rows[:, :, None] * w + cols).reshape(b, h_keep * w)  # (B, h_keep, w) -> (B, h_keep * w)
        return Selection(indices, (h_keep, w))


class L1NormRouting(RoutingPolicy):
    """Keep HIGH L1-norm tokens, mixed with random ones (SimpleTuner's importance routing).

    A fraction `random_mix` of the processed slots is drawn uniformly from the remaining tokens so that
    low-norm tokens still get trained sometimes. The subset has no grid.
    """

    name, yields_grid = "l1norm", False

    def __init__(self, random_mix: float = 0.5):
        if not 0.0 <= random_mix <= 1.0:
            raise ConfigError(f"routing.random_mix={random_mix} must be in [0, 1].")
        self.random_mix = random_mix

    def select(self, x, grid, selection_ratio, generator):
        b, n, _ = x.shape
        k = self.num_processed(grid, selection_ratio)
        k_top = round((1.0 - self.random_mix) * k)
        scores = uniform_scores(b, n, generator, x.device)  # in [0, 1)
        if k_top > 0:
            top = x.detach().abs().sum(-1).topk(k_top, dim=1).indices  # (B, k_top)
            # Scores above 1 guarantee the high-norm tokens win; the rest of the k slots go to random ones.
            scores = scores.scatter(1, top, 2.0)
        return Selection(random_subset(scores, k), None)


POLICIES = {"none": NoRouting, "random": RandomRouting, "rows": RowRouting, "l1norm": L1NormRouting}


def build_policy(name: str, **kwargs) -> RoutingPolicy:
    if name not in POLICIES:
        raise ConfigError(f"routing.policy='{name}' is unknown; choose one of {sorted(POLICIES)}.")
    return POLICIES[name](**kwargs)
