"""EDM formulas, loss weighting, the Heun sampler on exactly-known Gaussian data, and guidance."""

import math

import pytest
import torch

from edm import CFGDenoiser, EDMLoss, EDMPrecond, LogNormalSigma, edm_coefficients, edm_sigmas, reduce_loss, sample_euler, sample_heun


def test_preconditioning_coefficients_match_edm_table():
    sigma, sd = torch.tensor([0.1, 0.5, 2.0, 80.0], dtype=torch.float64), 0.5
    c_skip, c_out, c_in, c_noise = edm_coefficients(sigma, sd)
    for i, s in enumerate(sigma.tolist()):
        assert c_skip[i].item() == pytest.approx(sd**2 / (s**2 + sd**2))
        assert c_out[i].item() == pytest.approx(s * sd / math.sqrt(s**2 + sd**2))
        assert c_in[i].item() == pytest.approx(1 / math.sqrt(s**2 + sd**2))
        assert c_noise[i].item() == pytest.approx(math.log(s) / 4)


def test_precond_wraps_network_with_scaled_input():
    seen = {}

    class F(torch.nn.Module):
        def forward(self, x, c_noise, labels):
            seen["x"], seen["c_noise"] = x, c_noise
            return torch.ones_like(x)

    net = EDMPrecond(F(), sigma_data=0.5)
    x, sigma = torch.randn(2, 1, 4, 4), torch.tensor([0.3, 3.0])
    D = net(x, sigma)
    c_skip, c_out, c_in, c_noise = edm_coefficients(sigma.view(-1, 1, 1, 1), 0.5)
    torch.testing.assert_close(seen["x"], c_in * x)
    torch.testing.assert_close(seen["c_noise"], c_noise.flatten())
    torch.testing.assert_close(D, c_skip * x + c_out)


def test_loss_weight_is_lambda_and_unit_for_ideal_scale():
    loss = EDMLoss(sigma_data=0.5)
    sigma = torch.tensor([0.2, 1.0, 10.0])
    torch.testing.assert_close(loss.weight(sigma), (sigma**2 + 0.25) / (sigma * 0.5) ** 2)
    # lambda(sigma) * c_out(sigma)^2 == 1: the effective target of F has unit weight at every noise level.
    _, c_out, _, _ = edm_coefficients(sigma, 0.5)
    torch.testing.assert_close(loss.weight(sigma) * c_out**2, torch.ones(3))


def test_loss_of_perfect_denoiser_is_zero_and_uses_noise_times_sigma():
    y = torch.randn(3, 1, 4, 4)
    noise, sigma = torch.randn_like(y), torch.tensor([0.5, 1.0, 2.0])
    captured = {}

    def net(x, s, labels):
        captured["x"] = x
        return y

    out = EDMLoss()(net, y, None, sigma, noise)
    torch.testing.assert_close(captured["x"], y + noise * sigma.view(-1, 1, 1, 1))
    assert out.abs().max() == 0


def test_lognormal_sigma_moments():
    s = LogNormalSigma(-1.2, 1.2)(200_000, torch.Generator().manual_seed(0))
    assert s.log().mean().item() == pytest.approx(-1.2, abs=0.02)
    assert s.log().std().item() == pytest.approx(1.2, abs=0.02)


def test_route_aware_loss_averages_processed_pixels_per_route():
    loss = torch.arange(16.0).view(1, 1, 4, 4)
    mask_a = torch.tensor([[[True, False], [False, False]]])  # top-left 2x2 patch
    mask_b = torch.tensor([[[False, False], [False, True]]])  # bottom-right
    expected = (loss[..., :2, :2].mean() + loss[..., 2:, 2:].mean()) / 2
    torch.testing.assert_close(reduce_loss(loss, [mask_a, mask_b]), expected)
    torch.testing.assert_close(reduce_loss(loss, None), loss.mean())


def test_edm_sigmas_schedule():
    s = edm_sigmas(40)
    assert len(s) == 41 and s[-1] == 0
    assert s[0].item() == pytest.approx(80.0) and s[-2].item() == pytest.approx(0.002)
    assert (s[:-1].diff() < 0).all()


@pytest.mark.parametrize("sampler", [sample_heun, sample_euler])
def test_sampler_reproduces_gaussian_data_with_exact_denoiser(sampler):
    v = 0.7**2  # data ~ N(0, v): the exact denoiser is x v / (v + sigma^2)

    def exact(x, sigma):
        return x * v / (v + sigma.view(-1, 1, 1, 1) ** 2)

    n = 20_000
    sigmas = edm_sigmas(40 if sampler is sample_heun else 200)
    x0 = torch.randn(n, 1, 1, 1, generator=torch.Generator().manual_seed(0)) * sigmas[0]
    out = sampler(exact, x0, sigmas)
    assert out.var().item() == pytest.approx(v, rel=0.04)
    assert out.mean().item() == pytest.approx(0.0, abs=0.02)


def test_heun_with_churn_still_matches_variance():
    v = 0.25
    exact = lambda x, sigma: x * v / (v + sigma.view(-1, 1, 1, 1) ** 2)  # noqa: E731
    # Churn trades discretisation error for noise; 80 steps keep it within a few percent.
    sigmas = edm_sigmas(80)
    x0 = torch.randn(20_000, 1, 1, 1, generator=torch.Generator().manual_seed(1)) * sigmas[0]
    out = sample_heun(exact, x0, sigmas, S_churn=10, S_min=0.05, S_max=50, generator=torch.Generator().manual_seed(2))
    assert out.var().item() == pytest.approx(v, rel=0.04)


def test_cfg_scale_one_equals_conditional_and_extrapolates_otherwise():
    def net(x, sigma, labels):
        return x + labels.view(-1, 1, 1, 1).float()

    x, sigma, labels = torch.randn(4, 1, 2, 2), torch.ones(4), torch.tensor([0, 1, 2, 3])
    torch.testing.assert_close(CFGDenoiser(net, 1.0, null_label=9)(x, sigma, labels), net(x, sigma, labels))
    guided = CFGDenoiser(net, 3.0, null_label=9)(x, sigma, labels)
    D_c, D_u = net(x, sigma, labels), net(x, sigma, torch.full_like(labels, 9))
    torch.testing.assert_close(guided, D_u + 3.0 * (D_c - D_u))
