"""Routed inference (routing forced in eval mode at a chosen ratio), its FLOPs, seeding, and routing guidance."""

import pytest
import torch
from torch import nn

from backbones import build_backbone
from edm import EDMPrecond, FlowModel, RoutingGuidance, build_objective, generate
from routing import ConfigError, Route, Router, build_policy, count_flops, routed_flops


def tiny_dit(seed=0, routes=(Route(0.5, 2, 4),)):
    torch.manual_seed(seed)
    model = build_backbone("dit", "tiny", input_size=16, in_channels=1, patch_size=2, num_classes=10)
    # Non-zero adaLN and final layers, so every block and every token matters.
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    model.router = Router(build_policy("random"), list(routes))
    return model.eval()


def inputs(b=2):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 1, 16, 16, generator=g), torch.rand(b, generator=g), torch.tensor([1, 2, 3, 4][:b])


def test_ratio_zero_is_exactly_unrouted_and_other_ratios_route_every_route():
    model = tiny_dit(routes=(Route(0.5, 1, 2), Route(0.25, 4, 6)))
    x, t, y = inputs()
    reference = model(x, t, y)
    assert model.router.last_masks == []  # eval mode does not route by itself
    with model.router.forced(0.0):
        assert torch.equal(model(x, t, y), reference)
    with model.router.forced(0.75):
        routed = model(x, t, y)
        # Both trained routes now process 25% of the 64 tokens, whatever their trained ratio was.
        assert [m.sum(dim=1).tolist() for m in model.router.last_masks] == [[16, 16], [16, 16]]
    assert not torch.allclose(routed, reference)
    # The trained routes and eval-mode behaviour come back afterwards, also after an error.
    with pytest.raises(RuntimeError), model.router.forced(0.5):
        raise RuntimeError
    assert model.router.routes == [Route(0.5, 1, 2), Route(0.25, 4, 6)] and not model.router.force
    assert torch.equal(model(x, t, y), reference)


def test_nested_forcing_starts_from_the_trained_routes():
    router = Router(build_policy("random"), [Route(0.5, 1, 2)])
    with router.forced(0.0), router.forced(0.3):
        assert router.routes == [Route(0.3, 1, 2)]
    assert router.routes == [Route(0.5, 1, 2)]


def test_bad_forced_ratios_are_named():
    with pytest.raises(ConfigError, match="route ratio 1.0"), Router(build_policy("random"), [Route(0.5, 1, 2)]).forced(1.0):
        pass
    unrouted = r"has none \(it was trained without routing\); .* so sample this one without them"
    with pytest.raises(ConfigError, match=unrouted), Router(build_policy("random"), []).forced(0.5):
        pass


def test_flops_per_evaluation_shrink_with_the_ratio():
    model = tiny_dit()
    x, t, y = inputs()
    routed, unrouted = routed_flops(lambda: model(x, t, y), model.router, 0.5)
    assert unrouted == count_flops(lambda: model(x, t, y))
    # Blocks 2..4 of 8 run on half the tokens; the rest (and the embedders) are unchanged.
    assert 0.6 * unrouted < routed < 0.95 * unrouted
    assert routed_flops(lambda: model(x, t, y), model.router, 0.0) == (unrouted, unrouted)


@pytest.mark.parametrize("wrapper", [EDMPrecond, FlowModel])
def test_routing_guidance_is_the_two_ratio_extrapolation(wrapper):
    model = tiny_dit()
    net, router = wrapper(model), model.router
    x, t, y = inputs()

    def plain(gamma, seed, labels=y):
        router.generator = torch.Generator().manual_seed(seed)
        with router.forced(gamma):
            return net(x, t, labels)

    def guided(seed, **kwargs):
        router.generator = torch.Generator().manual_seed(seed)
        return RoutingGuidance(net, router.forced, **kwargs)(x, t, y)

    # The formula, with the branches evaluated in order from one seeded stream.
    router.generator = torch.Generator().manual_seed(5)
    with router.forced(0.3):
        D_1 = net(x, t, y)
    with router.forced(0.7):
        D_2 = net(x, t, y)
    torch.testing.assert_close(guided(5, gamma_1=0.3, gamma_2=0.7, w=2.5), D_2 + 2.5 * (D_1 - D_2))
    # w = 1 is the plain gamma_1 prediction; gamma_1 = gamma_2 is the unguided one.
    torch.testing.assert_close(guided(6, gamma_1=0.3, gamma_2=0.7, w=1.0), plain(0.3, 6))
    torch.testing.assert_close(guided(7, gamma_1=0.5, gamma_2=0.5, w=3.0), plain(0.5, 7))
    assert not torch.allclose(D_1, D_2)
    # The released variant: both branches get the null label.
    null = torch.full_like(y, 10)
    router.generator = torch.Generator().manual_seed(8)
    with router.forced(0.3):
        U_1 = net(x, t, null)
    with router.forced(0.7):
        U_2 = net(x, t, null)
    torch.testing.assert_close(guided(8, gamma_1=0.3, gamma_2=0.7, w=2.0, unconditional=True, null_label=10), U_2 + 2.0 * (U_1 - U_2))
    with pytest.raises(ValueError, match="gamma_1 <= gamma_2"):
        RoutingGuidance(net, router.forced, 0.7, 0.3, 2.0)


def test_routing_guidance_with_a_weaker_network_as_the_bad_branch():
    good, bad = tiny_dit(seed=0), tiny_dit(seed=1)
    net, bad_net = EDMPrecond(good), EDMPrecond(bad)
    x, t, y = inputs()
    out = RoutingGuidance(net, good.router.forced, None, None, 2.0, bad_net=bad_net, bad_force_ratio=bad.router.forced)(x, t, y)
    D_good, D_bad = net(x, t, y), bad_net(x, t, y)
    torch.testing.assert_close(out, D_bad + 2.0 * (D_good - D_bad))


@pytest.mark.parametrize("name", ["edm", "flow"])
def test_routed_sampling_repeats_with_its_seed(name):
    objective = build_objective(name)
    model = tiny_dit()
    net = objective.wrap(model)
    labels = torch.tensor([1, 2])
    guided = RoutingGuidance(net, model.router.forced, 0.25, 0.75, 1.5)

    def sample(seed, denoiser=guided, guidance=2.0):
        return generate(denoiser, labels, shape=(1, 16, 16), steps=3, guidance=guidance, seed=seed, device="cpu",
                        null_label=10, objective=objective, router=model.router)

    first = sample(0)
    torch.testing.assert_close(sample(0), first, rtol=0, atol=0)
    assert not torch.allclose(sample(1), first)
    assert model.router.generator is None  # restored after sampling
    # Routed inference at one ratio is seeded the same way; it differs from unrouted sampling.
    with model.router.forced(0.5):
        routed = sample(0, denoiser=net, guidance=1.0)
        torch.testing.assert_close(sample(0, denoiser=net, guidance=1.0), routed, rtol=0, atol=0)
    assert not torch.allclose(sample(0, denoiser=net, guidance=1.0), routed)
