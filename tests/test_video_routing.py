"""Selection on (t, h, w) video token grids: random, rows (per frame) and structured (2 x 2 x 2, or 1 x 2 x 2 when
the frame count is odd); a single frame (t = 1) selects exactly what the (h, w) image grid does."""

from __future__ import annotations

import pytest
import torch

from routing import ConfigError, build_policy

B = 3


def select(policy, grid, ratio, seed=0, **kwargs):
    n = 1
    for side in grid:
        n *= side
    p = build_policy(policy)
    return p, p.select(torch.zeros(B, n, 2), grid, ratio, torch.Generator().manual_seed(seed), **kwargs)


def coords(indices, grid):
    """(t, h, w) coordinates of raster indices."""
    t, h, w = grid
    return indices // (h * w), indices // w % h, indices % w


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_random_keeps_the_floor_of_the_kept_share_of_all_video_tokens(ratio):
    grid = (3, 4, 6)
    policy, sel = select("random", grid, ratio)
    k = int(72 * (1 - ratio))
    assert sel.indices.shape == (B, k) == (B, policy.num_processed(grid, ratio))
    assert (sel.indices.diff(dim=1) > 0).all() and sel.grid is None


@pytest.mark.parametrize("grid", [(3, 4, 6), (2, 8, 4)])
def test_rows_keeps_the_same_number_of_whole_rows_in_every_frame(grid):
    t, h, w = grid
    policy, sel = select("rows", grid, 0.5)
    assert sel.grid == (t, h // 2, w) and sel.indices.shape == (B, policy.num_processed(grid, 0.5)) == (B, t * h // 2 * w)
    frame, row, col = coords(sel.indices, grid)
    # (B, t, h_keep, w): frame f's rows come first, in order, each whole and in column order.
    frame, row, col = (v.view(B, t, h // 2, w) for v in (frame, row, col))
    assert torch.equal(frame, torch.arange(t)[None, :, None, None].expand_as(frame))
    assert torch.equal(col, torch.arange(w).expand_as(col))
    assert (row.diff(dim=2) > 0).all() and (row == row[..., :1]).all()
    # The frames choose their rows independently.
    assert any(not torch.equal(row[b, 0], row[b, f]) for b in range(B) for f in range(1, t))


def test_rows_keeps_every_row_of_a_frame_holding_a_forced_token():
    grid = (2, 4, 3)
    force = torch.zeros(B, 24, dtype=torch.bool)
    force[0, 1 * 12 + 3 * 3 + 2] = True  # frame 1, row 3
    _, sel = select("rows", grid, 0.75, force_keep=force)
    frame, row, _ = coords(sel.indices[0], grid)
    assert ((frame == 1) & (row == 3)).sum() == 3


def test_structured_cuts_even_frame_counts_into_2x2x2_groups_and_odd_ones_frame_by_frame():
    policy = build_policy("structured")
    assert policy.groups((4, 4, 6), 0.75) == ((2, 2, 2), 2)  # SPRINT's video setting
    assert policy.groups((5, 4, 6), 0.75) == ((1, 2, 2), 1)  # Wan's 4k + 1 frames often give odd latent frame counts
    assert policy.groups((1, 4, 6), 0.5) == ((1, 2, 2), 2)
    _, sel = select("structured", (5, 4, 6), 0.75)
    frame, row, col = coords(sel.indices, (5, 4, 6))
    groups = (frame * 2 + row // 2) * 3 + col // 2  # the 1 x 2 x 2 group of each kept token
    assert torch.equal(groups, torch.arange(30).expand(B, -1)) and sel.grid == (5, 2, 3)
    with pytest.raises(ConfigError, match="does not divide the 5x4x6 token grid"):
        build_policy("structured", group=2, keep=2).groups((5, 4, 6), 0.75)


@pytest.mark.parametrize("policy, ratio", [("rows", 0.5), ("structured", 0.75), ("structured", 0.5), ("random", 0.5)])
def test_a_single_frame_selects_what_the_image_grid_selects(policy, ratio):
    _, video = select(policy, (1, 6, 8), ratio, seed=4)
    _, image = select(policy, (6, 8), ratio, seed=4)
    assert torch.equal(video.indices, image.indices)
    assert video.grid == (None if image.grid is None else (1, *image.grid))
