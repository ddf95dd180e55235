"""Rectified flow: loss, time distributions, time grid, samplers on exactly-known Gaussian data, and the objective registry."""

import pytest
import torch

from edm import (
    EDM, EDMPrecond, Flow, FlowLoss, FlowModel, LogitNormalTime, UniformTime, build_objective, edm_sigmas, flow_times,
    generate, reduce_loss, sample_flow_euler, sample_flow_heun, sample_heun,
)


class Doubler(torch.nn.Module):
    """F(x, c_noise, labels) = 2 x; remembers the time conditioning it was given."""

    def forward(self, x, c_noise, labels):
        self.c_noise = c_noise
        return 2 * x


class Conv(torch.nn.Module):
    """A tiny trainable F(x, c_noise, labels)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x, c_noise, labels):
        return self.conv(x) * (1 + c_noise.view(-1, 1, 1, 1))


def test_flow_loss_equals_hand_computed_value():
    x = torch.tensor([1.0, 2.0, 0.0, 1.0]).view(2, 1, 1, 2)
    noise = torch.tensor([0.5, -1.0, 2.0, 2.0]).view(2, 1, 1, 2)
    t = torch.tensor([0.25, 1.0])
    F = Doubler()
    loss = FlowLoss()(FlowModel(F), x, None, t, noise)
    # Sample 0: z = 0.75 x + 0.25 eps = (0.875, 1.25), v = 2 z = (1.75, 2.5), target eps - x = (-0.5, -3).
    # Sample 1: t = 1 is pure noise, z = (2, 2), v = (4, 4), target = (2, 1).
    expected = torch.tensor([2.25**2, 5.5**2, 2.0**2, 3.0**2]).view(2, 1, 1, 2)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(reduce_loss(loss), torch.tensor(12.078125))
    # The backbone sees c_noise = t (its embedder scales it to DiT's [0, 1000]).
    torch.testing.assert_close(F.c_noise, t)


def test_flow_model_broadcasts_a_scalar_time():
    F = Doubler()
    FlowModel(F)(torch.randn(3, 1, 2, 2), torch.tensor(0.5))
    torch.testing.assert_close(F.c_noise, torch.full((3,), 0.5))


def test_time_distributions():
    g = torch.Generator().manual_seed(0)
    t = LogitNormalTime(loc=0.5, scale=0.8)(200_000, g)
    logit = torch.log(t / (1 - t))
    assert logit.mean().item() == pytest.approx(0.5, abs=0.01)
    assert logit.std().item() == pytest.approx(0.8, abs=0.01)
    u = UniformTime()(200_000, g)
    assert 0 <= u.min() and u.max() < 1 and u.mean().item() == pytest.approx(0.5, abs=0.01)


def test_flow_time_grid_runs_from_noise_to_data_and_shift_moves_steps_to_high_noise():
    t = flow_times(10)
    assert len(t) == 11 and t[0] == 1 and t[-1] == 0
    torch.testing.assert_close(t.diff(), torch.full((10,), -0.1, dtype=torch.float64))
    shifted = flow_times(10, shift=3.0)
    assert shifted[0] == 1 and shifted[-1] == 0 and (shifted.diff() < 0).all()
    assert (shifted[1:-1] > t[1:-1]).all()


def gaussian_velocity(s2, mu=0.0):
    """Exact E[eps - x | z_t] for data x ~ N(mu, s2): linear regression of v on z_t."""

    def v(z, t, class_labels=None):
        t = t.view(-1, 1, 1, 1)
        m = mu if class_labels is None else class_labels.view(-1, 1, 1, 1).to(z.dtype) * mu
        var_z = (1 - t) ** 2 * s2 + t**2
        cov_vz = t - (1 - t) * s2
        return -m + cov_vz / var_z * (z - (1 - t) * m)

    return v


@pytest.mark.parametrize("sampler, steps", [(sample_flow_euler, 200), (sample_flow_heun, 20)])
def test_flow_sampler_reproduces_gaussian_data_with_exact_velocity(sampler, steps):
    s2 = 0.7**2
    z1 = torch.randn(20_000, 1, 1, 1, generator=torch.Generator().manual_seed(0))
    out = sampler(gaussian_velocity(s2), z1, flow_times(steps))
    assert out.var().item() == pytest.approx(s2, rel=0.03)
    assert out.mean().item() == pytest.approx(0.0, abs=0.02)


def test_coarse_euler_misses_the_variance_so_the_test_above_can_fail():
    s2 = 0.7**2
    z1 = torch.randn(20_000, 1, 1, 1, generator=torch.Generator().manual_seed(0))
    out = sample_flow_euler(gaussian_velocity(s2), z1, flow_times(2))
    assert abs(out.var().item() / s2 - 1) > 0.03


def test_flow_generate_with_labels_and_cfg_reaches_class_means():
    # Class c has data N(c, 0.25): with w = 1 samples land on their class mean.
    v = gaussian_velocity(0.25, mu=1.0)
    labels = torch.tensor([0, 3] * 2000)
    x = generate(v, labels, shape=(1, 1, 1), steps=20, guidance=1.0, seed=0, device="cpu", null_label=9, objective=Flow())
    assert x[labels == 0].mean().item() == pytest.approx(0.0, abs=0.05)
    assert x[labels == 3].mean().item() == pytest.approx(3.0, abs=0.05)
    assert x[labels == 3].var().item() == pytest.approx(0.25, rel=0.1)


def test_default_objective_is_the_old_edm_path():
    torch.manual_seed(0)
    net = EDMPrecond(Conv())
    labels = torch.tensor([0, 1])
    kwargs = dict(shape=(1, 4, 4), steps=5, guidance=1.0, seed=7, device="cpu")
    # The pre-objective generate: noise from the seed, scaled by sigma_max, Heun on edm_sigmas.
    sigmas = edm_sigmas(5)
    noise = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(7))
    old = sample_heun(net, noise * sigmas[0], sigmas, extra_args={"class_labels": labels}).float()
    torch.testing.assert_close(generate(net, labels, **kwargs), old, rtol=0, atol=0)
    torch.testing.assert_close(generate(net, labels, objective=EDM(), **kwargs), old, rtol=0, atol=0)


def test_registry_builds_by_name_and_rejects_unknowns():
    edm, flow = build_objective("edm", sigma_data=1.0), build_objective("flow", time_dist="uniform", shift=2.0)
    assert isinstance(edm.wrap(Doubler()), EDMPrecond) and edm.wrap(Doubler()).sigma_data == 1.0
    assert isinstance(flow.wrap(Doubler()), FlowModel)
    assert edm.time_grid(4)[0].item() == pytest.approx(80.0) and flow.time_grid(4)[0] == 1
    assert set(edm.samplers) == set(flow.samplers) == {"euler", "heun"}
    assert 0 <= flow.sample_time(100, torch.Generator().manual_seed(0)).min()
    with pytest.raises(ValueError, match="objective.name='vp'"):
        build_objective("vp")
    with pytest.raises(ValueError, match="P_mean"):
        build_objective("flow", P_mean=0.0)
    with pytest.raises(ValueError, match="time_dist"):
        build_objective("flow", time_dist="cosine")
    with pytest.raises(ValueError, match="sampler='dpm'"):
        generate(FlowModel(Doubler()), torch.tensor([0]), shape=(1, 2, 2), steps=2, guidance=1.0, seed=0, device="cpu",
                 sampler="dpm", objective=flow)


@pytest.mark.parametrize("name", ["edm", "flow"])
def test_objective_loss_trains_through_its_wrapper(name):
    objective = build_objective(name)
    net = objective.wrap(Conv())
    x = torch.randn(4, 1, 4, 4)
    g = torch.Generator().manual_seed(0)
    t, noise = objective.sample_time(4, g), torch.randn(x.shape, generator=g)
    loss = reduce_loss(objective.loss(net, x, None, t, noise))
    loss.backward()
    assert loss.item() > 0 and net.model.conv.weight.grad.abs().sum() > 0
