"""Routing policies, route validation and the router, on plain modules and on real DiT blocks."""

import pytest
import torch
from torch import nn

from backbones import build_backbone
from routing import ConfigError, Route, Router, build_policy, resolve_routes
from routing.policy import POLICIES

GRID = (6, 8)
N = GRID[0] * GRID[1]


class Affine(nn.Module):
    """A block whose output differs from its input and depends on every parameter."""

    needs_grid = False

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.grids = []

    def forward(self, x, c, grid):
        self.grids.append(grid)
        return torch.tanh(self.lin(x)) + x + c[:, None]


def stack(depth=6, d=16, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(Affine(d) for _ in range(depth))


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"structured"}))  # group order and its own ratios: test_structured.py
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.8])
def test_selected_indices_unique_sorted_and_counted(name, ratio):
    policy = build_policy(name)
    x = torch.randn(5, N, 16)
    sel = policy.select(x, GRID, ratio, torch.Generator().manual_seed(0))
    expected = policy.num_processed(GRID, ratio)
    assert sel.indices.shape == (5, expected)
    assert (sel.indices.diff(dim=1) > 0).all(), "sorted and unique"
    assert sel.indices.min() >= 0 and sel.indices.max() < N
    if name in ("random", "l1norm"):
        assert expected == int(N * (1 - ratio) + 1e-9)
    if name == "rows":
        assert sel.grid == (int(GRID[0] * (1 - ratio) + 1e-9), GRID[1])


@pytest.mark.parametrize("name", ["random", "rows", "l1norm"])
def test_route_keeps_bypassing_tokens_exactly_and_processes_the_rest(name):
    blocks = stack()
    route = Route(0.5, 1, 3)
    router = Router(build_policy(name), [route])
    x, c = torch.randn(3, N, 16), torch.randn(3, 16)
    router.generator = torch.Generator().manual_seed(1)
    out = router.run(blocks, x, c, GRID, training=True)
    mask = router.last_masks[0]
    # Replay: blocks 0 on all, 1..3 on the processed subset only, 4..5 on all.
    h = blocks[0](x, c, GRID)
    for b in range(3):
        idx = mask[b].nonzero().squeeze(1)
        sub = h[b : b + 1, idx]
        for j in (1, 2, 3):
            sub = blocks[j](sub, c[b : b + 1], None)
        expected = h[b].clone()
        expected[idx] = sub[0]
        for j in (4, 5):
            expected = blocks[j](expected[None], c[b : b + 1], GRID)[0]
        torch.testing.assert_close(out[b], expected)
    # The bypassing tokens are exactly the route-start values before the last two full blocks: check directly.
    router.generator = torch.Generator().manual_seed(1)
    short = Router(build_policy(name), [Route(0.5, 1, 5)])
    short.generator = torch.Generator().manual_seed(1)
    out_short = short.run(blocks, x, c, GRID, training=True)
    keep = ~short.last_masks[0]
    assert torch.equal(out_short[keep], h[keep])


@pytest.mark.parametrize("name", ["random", "rows", "l1norm"])
def test_gradients_reach_every_token_and_parameter(name):
    blocks = stack()
    router = Router(build_policy(name), [Route(0.5, 0, 2), Route(0.25, 3, 4)])
    x = torch.randn(2, N, 16, requires_grad=True)
    router.run(blocks, x, torch.randn(2, 16), GRID, training=True).square().sum().backward()
    assert (x.grad.abs().sum(-1) > 0).all()
    for p in blocks.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert len(router.last_masks) == 2


def test_ratio_zero_is_the_unrouted_model_and_eval_mode_does_not_route():
    torch.manual_seed(0)
    model = build_backbone("dit", "tiny", input_size=16, in_channels=1, patch_size=2, num_classes=10)
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    x, t, y = torch.randn(2, 1, 16, 16), torch.randn(2), torch.tensor([1, 2])
    model.train()
    reference = model(x, t, y)
    model.router = Router(build_policy("random"), resolve_routes([{"selection_ratio": 0.0, "start_layer_idx": 2, "end_layer_idx": -4}], 8))
    torch.testing.assert_close(model(x, t, y), reference)
    model.router = Router(build_policy("random"), [Route(0.5, 2, 4)])
    assert not torch.allclose(model(x, t, y), reference)
    model.eval()
    torch.testing.assert_close(model(x, t, y), reference)
    assert model.router.last_masks == []
    model.router.force = True
    assert not torch.allclose(model(x, t, y), reference)


def test_rows_keep_whole_contiguous_rows_and_vary_per_sample():
    sel = build_policy("rows").select(torch.randn(64, N, 4), GRID, 0.5, torch.Generator().manual_seed(0))
    h_keep, w = sel.grid
    rows = sel.indices.view(64, h_keep, w)  # (B, K) -> (B, h_keep, w)
    assert (rows % w == torch.arange(w)).all(), "every kept row is complete, in scan order"
    assert (rows.diff(dim=2) == 1).all(), "contiguous along the row"
    assert (rows[:, :, 0] % w == 0).all()
    assert len({tuple(r[:, 0].tolist()) for r in rows}) > 10, "row sets differ between samples"


def test_rows_route_equals_running_blocks_on_the_row_cropped_image():
    blocks = stack(depth=3)
    router = Router(build_policy("rows"), [Route(0.5, 0, 2)])
    router.generator = torch.Generator().manual_seed(3)
    x, c = torch.randn(4, N, 16), torch.randn(4, 16)
    out = router.run(blocks, x, c, GRID, training=True)
    h_keep = GRID[0] // 2
    for b in range(4):
        kept_rows = router.last_masks[0][b].view(GRID).all(dim=1).nonzero().squeeze(1)
        crop = x[b].view(*GRID, 16)[kept_rows].reshape(1, h_keep * GRID[1], 16)  # (h_keep, w, D) -> (1, K, D)
        for blk in blocks:
            crop = blk(crop, c[b : b + 1], (h_keep, GRID[1]))
        torch.testing.assert_close(out[b].view(*GRID, 16)[kept_rows].reshape(-1, 16), crop[0])
    assert blocks[0].grids[0] == (h_keep, GRID[1])


def test_fp32_after_route_runs_the_next_block_without_autocast():
    seen = []

    class Probe(nn.Module):
        def forward(self, x, c, grid):
            seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
            return x

    blocks = nn.ModuleList(Probe() for _ in range(4))
    router = Router(build_policy("random"), [Route(0.5, 0, 1)], fp32_after_route=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        router.run(blocks, torch.randn(2, N, 8), torch.randn(2, 8), GRID, training=True)
    assert seen[2] == (torch.float32, False)
    assert seen[3][1] is True


@pytest.mark.parametrize(
    "routes, match",
    [
        ([{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 4}, {"selection_ratio": 0.5, "start_layer_idx": 4, "end_layer_idx": 6}], r"routes\[1\].*overlaps"),
        ([{"selection_ratio": 0.5, "start_layer_idx": 5, "end_layer_idx": 2}], r"routes\[0\].*start 5 > end 2"),
        ([{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 8}], r"routes\[0\].*outside"),
        ([{"selection_ratio": 0.5, "start_layer_idx": -9, "end_layer_idx": -2}], r"routes\[0\].*outside"),
        ([{"selection_ratio": 1.0, "start_layer_idx": 2, "end_layer_idx": 4}], r"routes\[0\].*selection_ratio"),
        ([{"selection_ratio": 0.5, "start": 2, "end_layer_idx": 4}], r"routes\[0\] must have the keys"),
    ],
)
def test_invalid_routes_are_named(routes, match):
    with pytest.raises(ConfigError, match=match):
        resolve_routes(routes, depth=8)


def test_negative_indices_resolve_like_the_paper():
    spec = [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}]
    assert [resolve_routes(spec, d)[0].end_layer_idx for d in (12, 24, 28)] == [8, 20, 24]


def test_rows_policy_that_drops_every_row_is_rejected():
    policy = build_policy("rows")
    with pytest.raises(ConfigError, match="lower selection_ratio"):
        policy.check((4, 8), 0.8)  # keeps floor(4 * 0.2) = 0 rows
    policy.check((4, 8), 0.75)
    with pytest.raises(ConfigError, match="lower selection_ratio"):
        build_policy("random").check((2, 2), 0.8)
    with pytest.raises(ConfigError, match="routing.policy='diagonal'"):
        build_policy("diagonal")


def test_l1norm_keeps_the_highest_norm_tokens():
    x = torch.randn(4, N, 8) * 0.01
    x[:, :5] *= 1000  # five loud tokens per sample
    sel = build_policy("l1norm", random_mix=0.5).select(x, GRID, 0.5, torch.Generator().manual_seed(0))
    for b in range(4):
        assert set(range(5)) <= set(sel.indices[b].tolist())


def test_flop_counter_counts_attention_on_the_cpu_as_a_hand_count_does():
    """routing.count_flops, the one counter of the sampling tools and benchmarks, against a hand count of one DiT
    attention layer: qkv and output projections plus the two attention matmuls (QK^T and AV), 2 FLOPs per MAC."""
    from timm.models.vision_transformer import Attention

    from routing import count_flops

    b, n, d, heads = 2, 64, 32, 4
    attention = Attention(d, num_heads=heads, qkv_bias=True)
    x = torch.randn(b, n, d)
    projections = 2 * b * n * d * (3 * d) + 2 * b * n * d * d
    matmuls = 2 * (2 * b * heads * n * n * (d // heads))
    assert count_flops(lambda: attention(x)) == projections + matmuls
