"""RoutingPolicy: which tokens a route processes.

A policy sees the token tensor and its grid and returns the indices of the tokens that run through the
route, in the order the route's blocks see them, and, when the subset is itself a grid, that grid. Most
policies keep raster order (sorted indices); `structured` orders its tokens group by group, so that the
subset reads as a smaller grid in raster order (see StructuredRouting).

Force-keep masks: `select(..., force_keep=mask)` with a (B, N) bool mask always processes the marked tokens
(e.g. the region a masked loss trains on) and applies `selection_ratio` to the rest only. Sample b then
needs F_b + floor((N - F_b)(1 - ratio)) tokens; a batch shares one subset size, the largest of these, so
samples with smaller masks process a few extra random tokens. The processed fraction rises from (1 - r) to
about 1 - r (1 - F/N): a mask covering a quarter of the image turns r = 0.5 into an effective 0.375.
`rows` keeps every row holding a forced token, so a mask that spans many rows costs more (see RowRouting).
The subset size follows the mask, so it is counted on the mask's host copy (`ForceKeep`): a masked route reads
nothing back from the device.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from einops import rearrange

from routing.errors import ConfigError

Grid = tuple[int, ...]  # (h, w) for images; (t, h, w) for video (the structured policy takes both)


@dataclass
class Selection:
    indices: torch.Tensor  # (B, K) int64, in processing order (ascending, except structured: group by group)
    grid: Grid | None  # the grid the processed tokens form in that order (e.g. (h_keep, w)), else None


class RoutingPolicy(ABC):
    """Chooses the processed subset of a route; `selection_ratio` is the fraction that bypasses."""

    name: str
    yields_grid: bool  # True if `select` keeps a 2-D grid, which scan-order blocks need

    def num_processed(self, grid: Grid, selection_ratio: float) -> int:
        """Number of tokens a route processes: floor(N * (1 - ratio)), as TREAD counts the kept tokens."""
        return kept(_numel(grid), selection_ratio)

    def check(self, grid: Grid, selection_ratio: float) -> None:
        """Raise ConfigError if this ratio leaves nothing to process on this grid."""
        if self.num_processed(grid, selection_ratio) < 1:
            raise ConfigError(
                f"routing policy '{self.name}' with selection_ratio={selection_ratio} on a {'x'.join(map(str, grid))} token grid "
                "leaves no token to process; lower selection_ratio."
            )

    @abstractmethod
    def select(
        self, x: torch.Tensor, grid: Grid, selection_ratio: float, generator: torch.Generator | Drawn | None,
        force_keep: torch.Tensor | ForceKeep | None = None,
    ) -> Selection:
        """x: (B, N, D) tokens in raster order on `grid`; force_keep: (B, N) bool, tokens always processed (a ForceKeep
        carries its host copy, so the subset size costs no device read)."""


def kept(n: int, selection_ratio: float) -> int:
    # The epsilon stops float error from flooring 100 * (1 - 0.9) = 9.999... down to 9.
    return int(n * (1.0 - selection_ratio) + 1e-9)


@dataclass(frozen=True)
class Drawn:
    """Uniform scores drawn before the forward (`Router.set_draws`), handed to a policy in place of a generator.

    scores: (B, W) in [0, 1), this micro-batch's rows of the global batch's draws; a policy that needs n <= W
    scores per sample takes the first n columns. Drawing outside the forward keeps torch.Generator calls out of a
    compiled graph, and makes the route of a sample a function of its index in the global batch alone.
    """

    scores: torch.Tensor


def uniform_scores(b: int, n: int, generator: torch.Generator | Drawn | None, device) -> torch.Tensor:
    """(B, N) uniform scores.

    With a CPU generator (or none) they are drawn on the CPU and copied, so a seed picks the same tokens on
    any device. A generator that lives on an accelerator (torch.Generator(device="cuda")) draws there, which
    saves the host-to-device copy every route; its stream differs from the CPU one, so a seed's choice then
    depends on the generator's device (as with any torch draw). Scores already drawn (`Drawn`) are sliced.
    """
    if isinstance(generator, Drawn):
        if generator.scores.shape[0] != b or generator.scores.shape[1] < n:
            raise ValueError(f"{tuple(generator.scores.shape)} drawn scores cannot give ({b}, {n}); draw them for this batch and grid.")
        return generator.scores[:, :n].to(device)
    if generator is not None and generator.device.type != "cpu":
        return torch.rand(b, n, generator=generator, device=generator.device).to(device)
    return torch.rand(b, n, generator=generator).to(device)


@dataclass(frozen=True)
class ForceKeep:
    """A force-keep mask and its values on the host: `mask` (B, N) bool beside the tokens, `host` the same values as
    a NumPy array, where the data loader built them (train/data/masks.py).

    A masked route's subset size follows the mask; counted on `host`, it costs no read back from the device. A bare
    (B, N) bool tensor is accepted wherever a ForceKeep is, and copied to the host at each route (on an accelerator,
    a host read per route): callers that route masked batches every step build a ForceKeep where the mask is made.
    """

    mask: torch.Tensor
    host: np.ndarray

    @classmethod
    def of(cls, mask: torch.Tensor | ForceKeep) -> ForceKeep:
        return mask if isinstance(mask, ForceKeep) else cls(mask, mask.detach().cpu().numpy())

    def to(self, device, non_blocking: bool = False) -> ForceKeep:
        """The mask on `device` (the step's copy of a batch); the host copy stays where it is."""
        return ForceKeep(self.mask.to(device, non_blocking=non_blocking), self.host)

    def pin_memory(self) -> ForceKeep:
        return ForceKeep(self.mask.pin_memory(), self.host)


def check_force_keep(force_keep: torch.Tensor | ForceKeep, n: int, batch: int | None = None) -> ForceKeep:
    """The mask as a ForceKeep, once its shape is checked against the route's n tokens (and `batch` samples)."""
    mask = force_keep.mask if isinstance(force_keep, ForceKeep) else force_keep
    if mask.dtype != torch.bool or mask.ndim != 2 or mask.shape[1] != n:
        raise ConfigError(
            f"force_keep must be a (batch, {n}) bool mask over the route's tokens, got {tuple(mask.shape)} "
            f"{mask.dtype}; pool a pixel mask to the token grid first."
        )
    if batch is not None and mask.shape[0] != batch:
        raise ConfigError(f"force_keep has {mask.shape[0]} rows but the batch has {batch} samples; give one mask row "
                          f"per sample, ({batch}, {n}).")
    keep = ForceKeep.of(force_keep)
    if keep.host.shape != tuple(mask.shape):
        raise ConfigError(f"a ForceKeep's host copy {keep.host.shape} does not match its mask {tuple(mask.shape)}; build both from one mask.")
    return keep


def forced_size(host: np.ndarray, n: int, selection_ratio: float) -> int:
    """Subset size shared by a batch under a (B, n) force-keep mask, counted on the host:
    max_b F_b + floor((n - F_b)(1 - ratio))."""
    return max(f + kept(n - f, selection_ratio) for f in host.sum(1).tolist())


def random_subset(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row indices of the k largest scores, sorted ascending: (B, N) -> (B, k)."""
    return scores.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


class NoRouting(RoutingPolicy):
    """Every token is processed: the control condition."""

    name, yields_grid = "none", True

    def num_processed(self, grid: Grid, selection_ratio: float) -> int:
        return _numel(grid)

    def select(self, x, grid, selection_ratio, generator, force_keep=None):
        b, n, _ = x.shape
        return Selection(torch.arange(n, device=x.device).expand(b, n), grid)


class RandomRouting(RoutingPolicy):
    """Uniform random subset per sample (TREAD's choice for attention); the subset has no grid."""

    name, yields_grid = "random", False

    def select(self, x, grid, selection_ratio, generator, force_keep=None):
        b, n, _ = x.shape
        scores = uniform_scores(b, n, generator, x.device)
        if force_keep is None:
            return Selection(random_subset(scores, self.num_processed(grid, selection_ratio)), None)
        # Scores above 1 make the forced tokens win; the other slots go to uniformly random tokens.
        keep = check_force_keep(force_keep, n, b)
        k = forced_size(keep.host, n, selection_ratio)
        return Selection(random_subset(scores.masked_fill(keep.mask, 2.0), k), None)


class RowRouting(RoutingPolicy):
    """A random subset of whole rows per sample; on a (t, h, w) video grid, the same number of rows in every frame.

    Kept rows stay complete and in order, so the subset is an (h_keep, w) grid, or (t, h_keep, w), in which a
    row scan or a token shift still sees true left/right neighbours; this is what scan-order models (RWKV,
    Mamba) need. Every frame keeps h_keep rows of its own choice, so frames stay in order and equally covered;
    a single frame (t = 1) draws exactly the rows the (h, w) image grid would.

    With a force-keep mask every row holding a forced token is kept and the ratio applies to the other rows,
    so a mask that touches many rows (a tall object) keeps most of the image: prefer `random` for masked loss.
    """

    name, yields_grid = "rows", True

    def rows_processed(self, grid: Grid, selection_ratio: float) -> int:
        return kept(grid[-2], selection_ratio)

    def num_processed(self, grid: Grid, selection_ratio: float) -> int:
        return _numel(grid[:-2]) * self.rows_processed(grid, selection_ratio) * grid[-1]

    def select(self, x, grid, selection_ratio, generator, force_keep=None):
        *frames, h, w = grid
        f, b = _numel(frames), x.shape[0]
        scores = uniform_scores(b, f * h, generator, x.device).reshape(b * f, h)  # (B, f * h) -> (B * f, h)
        if force_keep is None:
            h_keep = self.rows_processed(grid, selection_ratio)
        else:
            keep = check_force_keep(force_keep, f * h * w, b)
            forced_rows = keep.mask.reshape(b * f, h, w).any(-1)  # (B, f * h * w) -> (B * f, h)
            h_keep = forced_size(keep.host.reshape(b * f, h, w).any(-1), h, selection_ratio)  # the same rows, on the host
            scores = scores.masked_fill(forced_rows, 2.0)
        rows = random_subset(scores, h_keep).reshape(b, f, h_keep)  # (B * f, h_keep) -> (B, f, h_keep)
        rows = rows + torch.arange(f, device=x.device)[None, :, None] * h  # row index within the whole sequence
        cols = torch.arange(w, device=x.device)
        indices = (rows[..., None] * w + cols).reshape(b, f * h_keep * w)  # (B, f, h_keep, w) -> (B, f * h_keep * w)
        return Selection(indices, (*frames, h_keep, w))


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

    def select(self, x, grid, selection_ratio, generator, force_keep=None):
        b, n, _ = x.shape
        if force_keep is not None:
            return self._select_forced(x, selection_ratio, generator, force_keep)
        k = self.num_processed(grid, selection_ratio)
        k_top = round((1.0 - self.random_mix) * k)
        scores = uniform_scores(b, n, generator, x.device)  # in [0, 1)
        if k_top > 0:
            top = x.detach().abs().sum(-1).topk(k_top, dim=1).indices  # (B, k_top)
            # Scores above 1 guarantee the high-norm tokens win; the rest of the k slots go to random ones.
            scores = scores.scatter(1, top, 2.0)
        return Selection(random_subset(scores, k), None)

    def _select_forced(self, x, selection_ratio, generator, force_keep):
        # The norm/random split applies to the unforced tokens: sample b keeps its F_b forced tokens, its
        # round((1 - mix) k_b) highest-norm others and random ones, with k_b = floor((N - F_b)(1 - ratio)).
        b, n, _ = x.shape
        keep = check_force_keep(force_keep, n, b)
        k = forced_size(keep.host, n, selection_ratio)
        force_keep = keep.mask
        n_free = n - force_keep.sum(1)  # (B,)
        k_free = torch.floor(n_free.double() * (1.0 - selection_ratio) + 1e-9)
        k_top = torch.round((1.0 - self.random_mix) * k_free).long()  # (B,)
        norms = x.detach().abs().sum(-1).float().masked_fill(force_keep, float("-inf"))  # (B, N)
        order = norms.argsort(dim=1, descending=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=x.device).expand(b, n))
        top = (rank < k_top[:, None]) & ~force_keep
        scores = uniform_scores(b, n, generator, x.device).masked_fill(top, 2.0).masked_fill(force_keep, 3.0)
        return Selection(random_subset(scores, k), None)


class StructuredRouting(RoutingPolicy):
    """SPRINT's "structured with random offset" selection: the grid is cut into g x g groups (g x g x g on a
    (t, h, w) grid), and every group keeps s tokens at uniformly random positions inside it.

    Every region of the image keeps the same share of tokens, so the subset is a jittered regular sub-grid
    rather than random holes and clusters. The kept tokens are ordered group by group (groups in raster
    order, a group's s tokens in raster order inside it), so the subset is itself a grid in raster order:
    (h/g, w/g * s) on an (h, w) grid. With s = 1 that is exactly the (h/g, w/g) grid of groups, each kept
    token standing for its group: a scan or token shift then sees neighbouring regions as neighbours,
    which is why this suits scan-order backbones (RWKV, Mamba) as well as attention.

    g and s follow from the route's selection_ratio = 1 - s / g^d: the smallest g whose groups tile the grid
    and hold a whole number s of kept tokens. That reproduces SPRINT's four settings on images (0.75: g 2, s 1;
    0.5: g 2, s 2; 0.625: g 4, s 6; 0.875: g 4, s 2) and its video one (0.75: 2 x 2 x 2, s 2). A video whose
    frame count no such g divides (an odd count of latent frames, or a single frame) is grouped 1 x g x g, frame
    by frame as an image is (0.75: g 2, s 1). `group` and `keep` fix g and s instead; the route's ratio must
    then be the one they give.

    Force-keep masks: forced tokens take their group's slots first. Where a group holds more forced tokens
    than s, the route keeps them all, every sample keeps as many tokens as the batch's largest count (random
    extra ones), and the subset has no grid: fine for attention, the only blocks that are given masks.
    """

    name, yields_grid = "structured", True

    def __init__(self, group: int | None = None, keep: int | None = None):
        if (group is None) != (keep is None):
            raise ConfigError("routing.policy_kwargs must give both group and keep (g and s) or neither "
                              "(then they follow from each route's selection_ratio).")
        for key, value in (("group", group), ("keep", keep)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"routing.policy_kwargs.{key}={value!r} must be a whole number >= 1.")
        self.group, self.keep = group, keep

    def layout(self, grid: Grid, selection_ratio: float) -> tuple[int, int]:
        """(g, s) for this grid and ratio; ConfigError, naming the key, when the grid cannot give that ratio."""
        extents, s = self.groups(grid, selection_ratio)
        return extents[-1], s

    def groups(self, grid: Grid, selection_ratio: float) -> tuple[tuple[int, ...], int]:
        """(the group's extent along each side of the grid, s): g x g, g x g x g, or 1 x g x g on video (below)."""
        d, shape = len(grid), "x".join(map(str, grid))
        if self.group is not None:
            g, s = self.group, self.keep
            if s > g**d:
                raise ConfigError(f"routing.policy_kwargs.keep={s} exceeds the {g**d} tokens of a {'x'.join([str(g)] * d)} group; "
                                  f"choose keep <= {g**d}.")
            if any(n % g for n in grid):
                raise ConfigError(f"routing.policy_kwargs.group={g} does not divide the {shape} token grid; choose a group size "
                                  "that divides every side (on video: a frame count the group size divides).")
            if abs(1 - s / g**d - selection_ratio) > 1e-9:
                raise ConfigError(f"routing.policy_kwargs group={g}, keep={s} bypass {1 - s / g**d:g} of the tokens, but the route "
                                  f"asks selection_ratio={selection_ratio}; make them agree, or drop group and keep to derive them from the ratio.")
            return (g,) * d, s
        found = _smallest_group(grid, selection_ratio, temporal=False)
        if found is None and d == 3:
            # A video whose frame count the group does not divide (Wan's 4k + 1 frames often give an odd number of
            # latent frames; a single frame, t = 1, is an image) is grouped 1 x g x g: frame by frame, as images are.
            found = _smallest_group(grid, selection_ratio, temporal=True)
        if found is None:
            raise ConfigError(f"structured selection cannot bypass selection_ratio={selection_ratio} of a {shape} token grid: no group "
                              "size g that divides the grid keeps a whole number of tokens per group; use a ratio such as 0.5 or 0.75, "
                              "or set routing.policy_kwargs.group and keep.")
        return found

    def num_processed(self, grid: Grid, selection_ratio: float) -> int:
        extents, s = self.groups(grid, selection_ratio)
        return _numel(grid) // _numel(extents) * s

    def check(self, grid: Grid, selection_ratio: float) -> None:
        self.groups(grid, selection_ratio)

    def subset_grid(self, grid: Grid, selection_ratio: float) -> Grid:
        """The grid of the kept tokens in their order: the grid of groups, its last side times s."""
        extents, s = self.groups(grid, selection_ratio)
        groups = [n // e for n, e in zip(grid, extents)]
        return (*groups[:-1], groups[-1] * s)

    def select(self, x, grid, selection_ratio, generator, force_keep=None):
        extents, s = self.groups(grid, selection_ratio)
        b, n, _ = x.shape
        scores = uniform_scores(b, n, generator, x.device)  # (B, N), one per token in raster order
        members = _group_members(grid, extents, x.device)  # (G, group size): raster index of every member of every group
        if force_keep is not None:
            keep = check_force_keep(force_keep, n, b)
            counts = keep.host[:, _group_members(grid, extents)].sum(-1)  # (B, N) -> (B, G) forced tokens per group, on the host
            if counts.max() > s:
                # Each group keeps max(s, its forced count): the batch's largest sum is the subset size.
                k = int(np.maximum(counts, s).sum(1).max())
                return self._select_overfull(scores, members, keep.mask[:, members], s, k)  # (B, N) -> (B, G, group size)
            scores = scores.masked_fill(keep.mask, 2.0)  # forced tokens win their group's slots
        slots = scores[:, members].topk(s, dim=-1).indices.sort(dim=-1).values  # (B, N) -> (B, G, group size) -> (B, G, s)
        indices = members.expand(b, -1, -1).gather(2, slots)  # (B, G, s) raster indices, group by group
        return Selection(indices.reshape(b, -1), self.subset_grid(grid, selection_ratio))  # (B, G, s) -> (B, G * s)

    @staticmethod
    def _select_overfull(scores, members, forced, s, k) -> Selection:
        # Each group keeps max(s, its forced count) tokens: forced first, then its highest-scoring others; k is the
        # batch's largest count of kept tokens.
        b, n = scores.shape
        in_group = scores[:, members].masked_fill(forced, 2.0)  # (B, G, g^d)
        rank = in_group.argsort(-1, descending=True).argsort(-1)  # rank of each member inside its group
        quota = forced.sum(-1, keepdim=True).clamp(min=s)  # (B, G, 1)
        kept = torch.zeros(b, n, dtype=torch.bool, device=scores.device)
        kept[:, members.reshape(-1)] = (rank < quota).reshape(b, -1)  # (B, G, g^d) -> (B, N)
        # The batch shares one subset size: samples with fewer kept tokens take random extra ones.
        return Selection(random_subset(scores.masked_fill(kept, 3.0), k), None)


def _numel(grid: Grid) -> int:
    out = 1
    for n in grid:
        out *= n
    return out


def _smallest_group(grid: Grid, selection_ratio: float, temporal: bool) -> tuple[tuple[int, ...], int] | None:
    """The smallest g whose groups tile the grid and keep a whole s = (1 - ratio) * (group size) >= 1 tokens each:
    g x g (x g) groups, or with `temporal` 1 x g x g groups on a (t, h, w) grid; None if no g does."""
    sides = grid[1:] if temporal else grid
    for g in range(1, min(sides) + 1):
        extents = ((1,) if temporal else ()) + (g,) * len(sides)
        s = (1 - selection_ratio) * _numel(extents)
        if all(n % g == 0 for n in sides) and abs(s - round(s)) < 1e-6 and round(s) >= 1:
            return extents, round(s)
    return None


def _group_members(grid: Grid, extents: tuple[int, ...], device=None) -> torch.Tensor | np.ndarray:
    """(G, group size) raster indices of the tokens of each group; groups and members in raster order. device None:
    a NumPy array, for counting a force-keep mask on the host."""
    raster = (np.arange(_numel(grid)) if device is None else torch.arange(_numel(grid), device=device)).reshape(grid)
    if len(grid) == 2:
        return rearrange(raster, "(h gh) (w gw) -> (h w) (gh gw)", gh=extents[0], gw=extents[1])
    if len(grid) == 3:
        return rearrange(raster, "(t gt) (h gh) (w gw) -> (t h w) (gt gh gw)", gt=extents[0], gh=extents[1], gw=extents[2])
    raise ConfigError(f"structured selection works on 2-D (h, w) and 3-D (t, h, w) token grids, not {len(grid)}-D.")


POLICIES = {"none": NoRouting, "random": RandomRouting, "rows": RowRouting, "l1norm": L1NormRouting, "structured": StructuredRouting}


def build_policy(name: str, **kwargs) -> RoutingPolicy:
    if name not in POLICIES:
        raise ConfigError(f"routing.policy='{name}' is unknown; choose one of {sorted(POLICIES)}.")
    params = inspect.signature(POLICIES[name].__init__).parameters.values()
    accepted = [p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(f"routing.policy_kwargs {unknown} are not arguments of routing policy '{name}'; it takes "
                          f"{', '.join(accepted) or 'none'}.")
    return POLICIES[name](**kwargs)
