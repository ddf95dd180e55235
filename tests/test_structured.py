"""SPRINT's structured selection: s tokens at random positions in every g x g (x g) group, in sub-grid order."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from routing import ConfigError, Route, Router, build_policy, resolve_routes

GRID = (8, 12)
N = GRID[0] * GRID[1]

# SPRINT's four image settings: selection_ratio -> (g, s).
SPRINT_RATIOS = {0.75: (2, 1), 0.5: (2, 2), 0.625: (4, 6), 0.875: (4, 2)}


def select(ratio, grid=GRID, b=6, seed=0, **kwargs):
    n = 1
    for side in grid:
        n *= side
    policy = build_policy("structured", **kwargs)
    return policy, policy.select(torch.randn(b, n, 4), grid, ratio, torch.Generator().manual_seed(seed))


def group_of(indices: torch.Tensor, grid, g: int) -> torch.Tensor:
    """Raster group id of each raster token index."""
    coords = []
    for side in reversed(grid):
        coords.append(indices % side)
        indices = indices // side
    coords = coords[::-1]  # (t,) h, w
    group = torch.zeros_like(coords[0])
    for c, side in zip(coords, grid):
        group = group * (side // g) + c // g
    return group


@pytest.mark.parametrize("ratio", sorted(SPRINT_RATIOS))
def test_the_four_sprint_ratios_keep_exactly_s_per_group_in_group_order(ratio):
    g, s = SPRINT_RATIOS[ratio]
    grid = (8, 16)
    policy, sel = select(ratio, grid)
    assert policy.layout(grid, ratio) == (g, s)
    groups = (grid[0] // g) * (grid[1] // g)
    assert sel.indices.shape == (6, groups * s) == (6, policy.num_processed(grid, ratio))
    assert sel.grid == (grid[0] // g, grid[1] // g * s)
    ids = group_of(sel.indices, grid, g)  # (B, G * s)
    # Group by group in raster order, s tokens each, all distinct: the subset is the grid of groups.
    assert torch.equal(ids, torch.arange(groups).repeat_interleave(s).expand(6, -1))
    assert (sel.indices.view(6, groups, s).diff(dim=-1) > 0).all(), "a group's tokens in raster order"
    assert sel.indices.unique(dim=1).shape == sel.indices.shape


def test_with_one_token_per_group_the_subset_reads_as_the_grid_of_groups_in_scan_order():
    """What a row scan (RWKV's Q-shift, Mamba's row-major scan) sees: subset position (i, j) lies in group (i, j),
    so its left/right/up/down neighbours in the subset are the tokens of the neighbouring groups."""
    _, sel = select(0.75)
    h, w = sel.grid
    rows, cols = sel.indices // GRID[1], sel.indices % GRID[1]  # (B, h * w) token coordinates
    assert torch.equal(rows.view(6, h, w) // 2, torch.arange(h)[:, None].expand(6, h, w))
    assert torch.equal(cols.view(6, h, w) // 2, torch.arange(w)[None, :].expand(6, h, w))


def test_offsets_inside_a_group_are_uniform():
    """Chi-square over many draws: with g = 2, s = 1 each of the 4 in-group positions is picked 1/4 of the time,
    and with g = 4, s = 6 each of the 16 positions is kept 6/16 of the time."""
    for ratio, g in ((0.75, 2), (0.625, 4)):
        _, sel = select(ratio, b=400, seed=3)
        offsets = (sel.indices // GRID[1] % g) * g + sel.indices % GRID[1] % g  # position inside the group
        counts = torch.bincount(offsets.flatten(), minlength=g * g).double()
        assert chisquare(counts.numpy()).pvalue > 1e-3, counts
        # A biased draw (always the first cell of the group) is what the test must catch.
        assert chisquare(torch.bincount((offsets.flatten() * 0), minlength=g * g).double().numpy() + 1).pvalue < 1e-6


def test_equal_seeds_give_equal_selections_and_other_seeds_differ():
    a, b, c = (select(0.75, seed=s)[1].indices for s in (7, 7, 8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_three_d_grids_use_g_cubed_groups():
    grid = (4, 4, 6)
    policy, sel = select(0.75, grid)
    assert policy.layout(grid, 0.75) == (2, 2)  # SPRINT's video setting: 2 x 2 x 2 groups keep 2
    groups = 2 * 2 * 3
    assert sel.grid == (2, 2, 3 * 2)
    assert torch.equal(group_of(sel.indices, grid, 2), torch.arange(groups).repeat_interleave(2).expand(6, -1))


def test_ratio_zero_keeps_every_token_in_raster_order():
    _, sel = select(0.0)
    assert torch.equal(sel.indices, torch.arange(N).expand(6, N)) and sel.grid == GRID


def test_given_group_and_keep_fix_the_layout():
    policy, sel = select(0.625, (8, 16), group=4, keep=6)
    assert sel.grid == (2, 4 * 6)
    with pytest.raises(ConfigError, match="selection_ratio=0.5"):
        policy.check((8, 16), 0.5)


@pytest.mark.parametrize("kwargs, grid, ratio, match", [
    ({"group": 0, "keep": 1}, GRID, 0.75, r"policy_kwargs.group=0"),
    ({"group": 2, "keep": 5}, GRID, 0.75, r"policy_kwargs.keep=5 exceeds the 4 tokens"),
    ({"group": 2}, GRID, 0.75, r"both group and keep"),
    ({"group": 5, "keep": 1}, GRID, 0.96, r"group=5 does not divide the 8x12"),
    ({}, GRID, 0.3, r"cannot bypass selection_ratio=0.3 of a 8x12 token grid"),
    ({}, (7, 7), 0.75, r"cannot bypass selection_ratio=0.75 of a 7x7"),
    ({"size": 2}, GRID, 0.75, r"policy_kwargs \['size'\] are not arguments of routing policy 'structured'"),
])
def test_bad_values_are_refused_in_one_sentence_naming_the_key(kwargs, grid, ratio, match):
    with pytest.raises(ConfigError, match=match):
        build_policy("structured", **kwargs).check(grid, ratio)


def test_force_keep_fills_group_slots_first_and_keeps_overfull_groups_whole():
    policy = build_policy("structured")
    x = torch.randn(2, N, 4)
    light = torch.zeros(2, N, dtype=torch.bool)
    light[0, [0, 27, 50]] = True  # in three different 2x2 groups
    sel = policy.select(x, GRID, 0.75, torch.Generator().manual_seed(0), force_keep=light)
    assert sel.grid == (4, 6), "one forced token per group still fits the structure"
    assert light[0][sel.indices[0]].sum() == 3
    heavy = light.clone()
    heavy[1, [0, 1, 12, 13]] = True  # a whole 2x2 group
    sel = policy.select(x, GRID, 0.75, torch.Generator().manual_seed(0), force_keep=heavy)
    processed = torch.zeros(2, N, dtype=torch.bool).scatter_(1, sel.indices, True)
    assert processed[heavy].all() and sel.grid is None
    assert sel.indices.shape[1] == 24 + 3, "the overfull group keeps all 4: 3 more than the plain 24"


def test_a_route_gathers_group_order_and_scatters_back_to_raster_positions():
    """Routes accept indices in any order: the processed tokens return to their own positions."""
    route = resolve_routes([{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": 0}], 1)
    router = Router(build_policy("structured"), route)
    seen = {}

    def block(x, c, grid):
        seen["grid"] = grid
        return x + 1.0

    x = torch.randn(3, N, 4)
    router.generator = torch.Generator().manual_seed(0)
    out = router.run([block], x, torch.zeros(3, 4), GRID, training=True)
    processed = router.last_masks[0]
    assert seen["grid"] == (4, 6)
    assert torch.equal(out[processed], x[processed] + 1) and torch.equal(out[~processed], x[~processed])
    assert Route(0.75, 0, 0) == route[0]
