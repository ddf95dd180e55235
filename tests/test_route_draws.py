"""Router.set_draws: a sample's route is a function of (seed, step, sample index), whatever the micro-batch split."""

import pytest
import torch
from torch import nn

from backbones import build_backbone
from routing import Route, Router, build_policy
from routing.policy import POLICIES

GRID = (4, 8)
N = GRID[0] * GRID[1]


class Affine(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, c, grid):
        return torch.tanh(self.lin(x)) + x + c[:, None]


def step_generator(seed=7):
    return torch.Generator().manual_seed(seed)  # seeded by (seed, step) only: one per step, shared by micro-batches


def forced_masks(b):
    # The same number of forced tokens in every sample, so a half-batch shares the whole batch's subset size.
    force = torch.zeros(b, N, dtype=torch.bool)
    force[:, 3] = True
    force[torch.arange(b), torch.arange(b) + 10] = True
    return force


def route_masks(router, blocks, x, c, start, total, force=None):
    router.set_draws(step_generator(), start, total)
    out = router.run(blocks, x, c, GRID, training=True, force_keep=force)
    return out, torch.stack(router.last_masks, 1)  # routes x (B, N) -> (B, routes, N)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("tokens_known", [True, False])
def test_a_batch_drawn_whole_equals_its_halves_drawn_at_their_offsets(name, forced, tokens_known):
    torch.manual_seed(0)
    blocks = nn.ModuleList(Affine(16) for _ in range(6))
    router = Router(build_policy(name), [Route(0.5, 1, 2), Route(0.5, 3, 4)])
    router.tokens = N if tokens_known else None  # known: drawn in set_draws; unknown: drawn at the forward
    x, c = torch.randn(6, N, 16), torch.randn(6, 16)
    force = forced_masks(6) if forced else None
    whole_out, whole = route_masks(router, blocks, x, c, 0, 6, force)
    parts = [route_masks(router, blocks, x[s : s + 3], c[s : s + 3], s, 6, None if force is None else force[s : s + 3]) for s in (0, 3)]
    assert torch.equal(whole, torch.cat([m for _, m in parts]))
    torch.testing.assert_close(whole_out, torch.cat([o for o, _ in parts]), rtol=1e-6, atol=1e-6)
    if name != "none":
        assert not torch.equal(whole[:, 0], whole[:, 1]), "each route draws its own scores"
        assert not torch.equal(whole[0], whole[1]), "each sample draws its own scores"
    if forced:
        assert whole[force[:, None].expand_as(whole)].all(), "forced tokens are processed by every route"


def test_sprint_path_drop_and_selection_do_not_depend_on_the_split():
    torch.manual_seed(0)
    model = build_backbone("dit", "tiny", input_size=16, in_channels=1, patch_size=2, num_classes=4, depth=4).train()
    model.attach_router(Router(build_policy("structured"), [Route(0.75, 1, 2, mode="sprint", path_drop=0.5)]))
    x, t, y = torch.randn(8, 1, 16, 16), torch.rand(8), torch.tensor([0, 1, 2, 3] * 2)
    model.router.set_draws(step_generator(), 0, 8)
    whole, masks = model(x, t, y), model.router.last_masks[0]
    outs, parts = [], []
    for start in (0, 2, 4, 6):  # four micro-batches of 2, as 4 processes or grad_accum=4 would give
        model.router.set_draws(step_generator(), start, 8)
        outs.append(model(x[start : start + 2], t[start : start + 2], y[start : start + 2]))
        parts.append(model.router.last_masks[0])
    assert torch.equal(masks, torch.cat(parts))
    torch.testing.assert_close(whole, torch.cat(outs), rtol=1e-5, atol=1e-6)
    # At this seed path drop takes some samples and not others, so the comparison covers both.
    model.router.set_draws(step_generator(), 0, 8)
    drops = model.router._drawn[:, 0, -1] < 0.5  # (total, routes, N + 1) -> (total,) path-drop draws
    assert drops.any() and not drops.all()


def test_one_generator_object_serves_every_micro_batch_and_other_steps_draw_anew():
    router = Router(build_policy("random"), [Route(0.5, 0, 0)])
    router.tokens = N
    blocks, x, c = nn.ModuleList([Affine(16)]), torch.randn(4, N, 16), torch.randn(4, 16)
    shared = step_generator()
    first = [route_masks_with(router, blocks, x[s : s + 2], c[s : s + 2], shared, s) for s in (0, 2)]
    router.set_draws(step_generator(), 0, 4)
    router.run(blocks, x, c, GRID, training=True)
    assert torch.equal(torch.cat(first), router.last_masks[0]), "set_draws copies the generator's state"
    router.set_draws(step_generator(seed=8), 0, 4)  # the next step's generator
    router.run(blocks, x, c, GRID, training=True)
    assert not torch.equal(torch.cat(first), router.last_masks[0])


def route_masks_with(router, blocks, x, c, generator, start):
    router.set_draws(generator, start, 4)
    router.run(blocks, x, c, GRID, training=True)
    return router.last_masks[0]


def test_eval_forwards_keep_the_router_generator_and_none_turns_draws_off():
    router = Router(build_policy("random"), [Route(0.5, 0, 0)], force=True)
    router.tokens = N
    blocks, x, c = nn.ModuleList([Affine(16)]), torch.randn(2, N, 16), torch.randn(2, 16)

    def masks(training):
        router.generator = torch.Generator().manual_seed(1)
        router.run(blocks, x, c, GRID, training=training)
        return router.last_masks[0]

    plain_eval, plain_train = masks(False), masks(True)
    router.set_draws(step_generator(), 0, 2)
    assert torch.equal(masks(False), plain_eval), "sampling draws from router.generator"
    assert not torch.equal(masks(True), plain_train), "training draws from set_draws"
    router.set_draws(None)
    assert torch.equal(masks(True), plain_train)


def test_a_micro_batch_beyond_the_global_batch_is_refused():
    router = Router(build_policy("random"), [Route(0.5, 0, 0)])
    blocks, x, c = nn.ModuleList([Affine(16)]), torch.randn(3, N, 16), torch.randn(3, 16)
    router.set_draws(step_generator(), 2, 4)
    with pytest.raises(ValueError, match="exceeds the global batch of 4"):
        router.run(blocks, x, c, GRID, training=True)
    with pytest.raises(ValueError, match="0 <= start < total"):
        router.set_draws(step_generator(), 4, 4)


@pytest.mark.parametrize("family, policy, route", [
    ("dit", "random", Route(0.5, 1, 2)),
    ("dit", "rows", Route(0.5, 1, 2)),
    ("dit", "structured", Route(0.75, 1, 2, mode="sprint", path_drop=0.25)),
    ("diffmoe", "random", Route(0.5, 1, 2)),  # the global pool's threshold EMA decides on the device
])
def test_a_routed_training_forward_and_backward_read_nothing_back_to_the_host(family, policy, route, monkeypatch):
    from edm import EDMPrecond
    from edm.objectives import EDM

    model = build_backbone(family, "tiny", input_size=16, in_channels=1, patch_size=2, num_classes=4, depth=4)
    model.attach_router(Router(build_policy(policy), [route], fp32_after_route=True))
    net = EDMPrecond(model).train()
    x, noise, sigma, labels = torch.randn(4, 1, 16, 16), torch.randn(4, 1, 16, 16), torch.rand(4) + 0.1, torch.tensor([0, 1, 2, 3])

    def host_read(*args, **kwargs):
        raise AssertionError("the step read a tensor back to the host")

    for name in ("__bool__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    for step in range(2):  # the second step takes DiffMoE's threshold EMA branch
        model.router.set_draws(step_generator(step), 0, 4)
        EDM(sigma_data=0.5).loss(net, x, labels, sigma, noise).mean().backward()
