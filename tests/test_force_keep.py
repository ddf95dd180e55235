"""Force-keep masks for every routing policy, and where uniform scores are drawn."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from routing import ConfigError, ForceKeep, Route, Router, RoutingPolicy, Selection, build_policy
from routing.policy import POLICIES, kept, uniform_scores

GRID = (6, 8)
N = GRID[0] * GRID[1]


def masks(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    force = torch.rand(b, N, generator=g) < torch.tensor([0.0, 0.1, 0.3, 0.9])[:b, None]  # none .. most forced
    return force


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"structured"}))  # its own semantics: test_structured.py
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.75, 0.95])
def test_forced_tokens_are_always_selected_and_the_ratio_applies_to_the_rest(name, ratio):
    force = masks()
    x = torch.randn(4, N, 8)
    sel = build_policy(name).select(x, GRID, ratio, torch.Generator().manual_seed(1), force_keep=force)
    processed = torch.zeros(4, N, dtype=torch.bool).scatter_(1, sel.indices, True)
    assert (processed[force]).all(), "every forced token is processed"
    assert (sel.indices.diff(dim=1) > 0).all(), "sorted and unique"
    if name == "none":
        assert processed.all()
        return
    if name == "rows":
        rows = force.view(4, *GRID).any(-1)  # (B, h)
        h_keep = max(int(r.sum()) + kept(GRID[0] - int(r.sum()), ratio) for r in rows)
        assert sel.grid == (h_keep, GRID[1])
        kept_rows = processed.view(4, *GRID)
        assert (kept_rows.all(-1) | ~kept_rows.any(-1)).all(), "whole rows only"
        assert kept_rows.all(-1)[rows].all(), "every row holding a forced token"
        return
    f = force.sum(1)
    k = max(int(fb) + kept(N - int(fb), ratio) for fb in f)
    assert sel.indices.shape == (4, k), "one subset size per batch: the largest sample's need"
    free_processed = (processed & ~force).sum(1)
    for b in range(4):
        assert free_processed[b] >= kept(N - int(f[b]), ratio), "the ratio applies to the unforced tokens"
    assert sel.grid is None


def test_an_empty_mask_selects_what_no_mask_selects():
    x = torch.randn(3, N, 8)
    for name in sorted(POLICIES):
        policy = build_policy(name)
        plain = policy.select(x, GRID, 0.5, torch.Generator().manual_seed(2))
        empty = policy.select(x, GRID, 0.5, torch.Generator().manual_seed(2), force_keep=torch.zeros(3, N, dtype=torch.bool))
        assert plain.grid == empty.grid
        if name == "l1norm":  # same size, same high-norm share; ties may break differently
            assert plain.indices.shape == empty.indices.shape
        else:
            assert torch.equal(plain.indices, empty.indices), name


def test_l1norm_keeps_its_high_norm_share_among_the_unforced_tokens():
    x = torch.randn(2, N, 8)
    force = torch.zeros(2, N, dtype=torch.bool)
    force[:, :10] = True
    x[:, 10:15] *= 100  # the five highest-norm unforced tokens
    sel = build_policy("l1norm", random_mix=0.5).select(x, GRID, 0.5, torch.Generator().manual_seed(0), force_keep=force)
    processed = torch.zeros(2, N, dtype=torch.bool).scatter_(1, sel.indices, True)
    assert processed[:, :15].all()
    assert sel.indices.shape[1] == 10 + kept(N - 10, 0.5)


def test_router_passes_the_mask_to_every_route():
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
    stack = [lambda x, c, grid, blk=blk: blk(x) for blk in blocks]
    router = Router(build_policy("random"), [Route(0.9, 0, 1), Route(0.5, 3, 4)])
    router.generator = torch.Generator().manual_seed(0)
    force = masks()
    router.run(stack, torch.randn(4, N, 8), None, GRID, training=True, force_keep=force)
    assert len(router.last_masks) == 2
    for processed in router.last_masks:
        assert processed[force].all()
    with pytest.raises(ConfigError, match=r"force_keep must be a \(batch, 48\) bool mask"):
        router.run(stack, torch.randn(4, N, 8), None, GRID, training=True, force_keep=force[:, :10])


def test_a_policy_written_before_force_keep_still_routes_without_a_mask():
    class EveryOther(RoutingPolicy):
        name, yields_grid = "every_other", False

        def select(self, x, grid, selection_ratio, generator):  # the old signature
            b, n, _ = x.shape
            return Selection(torch.arange(0, n, 2).expand(b, -1), None)

    router = Router(EveryOther(), [Route(0.5, 0, 0)])
    out = router.run([lambda x, c, grid: x + 1], torch.zeros(2, N, 1), None, GRID, training=True)
    assert out[:, ::2].eq(1).all() and out[:, 1::2].eq(0).all()


def test_cpu_generator_draws_exactly_as_before():
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(uniform_scores(3, 10, g1, "cpu"), torch.rand(3, 10, generator=g2))
    assert uniform_scores(3, 10, None, "cpu").shape == (3, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_generator_draws_on_the_device():
    g1, g2 = torch.Generator(device="cuda").manual_seed(7), torch.Generator(device="cuda").manual_seed(7)
    scores = uniform_scores(3, 10, g1, torch.device("cuda"))
    assert scores.device.type == "cuda"
    assert torch.equal(scores, torch.rand(3, 10, generator=g2, device="cuda"))
    # A CPU generator still picks the same tokens on the GPU as on the CPU.
    x = torch.randn(2, N, 4)
    on_cpu = build_policy("random").select(x, GRID, 0.5, torch.Generator().manual_seed(3))
    on_gpu = build_policy("random").select(x.cuda(), GRID, 0.5, torch.Generator().manual_seed(3))
    assert torch.equal(on_cpu.indices, on_gpu.indices.cpu())


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_mask_with_its_host_copy_selects_what_the_bare_mask_selects(name):
    """ForceKeep (the trainer's masks: the subset size counted on the host copy) and the bare tensor give one selection,
    including structured selection's overfull groups (the 0.9 row forces more tokens than a group's slots)."""
    force, x = masks(), torch.randn(4, N, 8)
    policy = build_policy(name)
    bare = policy.select(x, GRID, 0.75, torch.Generator().manual_seed(3), force_keep=force)
    held = policy.select(x, GRID, 0.75, torch.Generator().manual_seed(3), force_keep=ForceKeep.of(force).to("cpu"))
    assert torch.equal(bare.indices, held.indices) and bare.grid == held.grid


def test_a_host_copy_that_is_not_the_masks_is_refused():
    force = masks()
    with pytest.raises(ConfigError, match="host copy"):
        build_policy("random").select(torch.randn(4, N, 8), GRID, 0.5, None, force_keep=ForceKeep(force, force[:2].numpy()))


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"none"}))
def test_a_mask_with_another_batch_size_is_refused_in_one_sentence(name):
    """3 mask rows for 2 samples: one sentence naming both sizes, not PyTorch's size mismatch from inside select."""
    for rows in (3, 1):
        mask = torch.zeros(rows, N, dtype=torch.bool)
        for force in (mask, ForceKeep.of(mask)):
            said = rf"force_keep has {rows} rows but the batch has 2 samples; give one mask row per sample, \(2, {N}\)"
            with pytest.raises(ConfigError, match=said):
                build_policy(name).select(torch.randn(2, N, 8), GRID, 0.5, torch.Generator().manual_seed(0),
                                          force_keep=force)
