"""Rectified flow (Liu et al. 2022; SiT; SD3), as TREAD's released rf.py trains it.

Interpolant z_t = (1 - t) x + t eps with t in [0, 1] (t = 1 is pure noise); the network predicts the
velocity v(z_t, t) and is trained towards dz_t/dt = eps - x. Sampling integrates dz/dt = v from t = 1 to 0.

Time conditioning: the backbone receives c_noise = t itself. Its TimestepEmbedder multiplies c_noise by
1000, so t in [0, 1] lands on DiT's usual timestep range [0, 1000], and EDM's c_noise = ln(sigma)/4
(about [-1.5, 1.1]) has the same magnitude: one embedder serves both objectives without retuning.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm


class LogitNormalTime:
    """t = sigmoid(n), n ~ N(loc, scale^2): the "logit_sigmoid" draw of rf.py (SD3 uses loc 0, scale 1)."""

    def __init__(self, loc: float = 0.0, scale: float = 1.0):
        if scale <= 0:
            raise ValueError(f"objective.scale must be positive, got {scale}")
        self.loc, self.scale = loc, scale

    def __call__(self, n: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        return torch.sigmoid(torch.randn(n, generator=generator, device=device) * self.scale + self.loc)


class UniformTime:
    """t ~ U(0, 1)."""

    def __call__(self, n: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        return torch.rand(n, generator=generator, device=device)


class FlowModel(nn.Module):
    """v(z, t) = F(z, t, labels): no preconditioning, only the EDMPrecond call shape (x, t, class_labels)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, z: torch.Tensor, t: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        t = t.float().reshape(-1).expand(z.shape[0])  # () or (B,) -> (B,)
        return self.model(z, t, class_labels).float()


class FlowLoss:
    """Per-element ||(eps - x) - v(z_t, t)||^2 with z_t = (1 - t) x + t eps; its mean is rf.py's loss."""

    def __call__(self, net, x: torch.Tensor, labels, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x: clean data (B, C, H, W), or video (B, C, T, H, W); t (B,); noise: standard normal like x. Returns x's shape."""
        t4 = t.reshape(-1, *(1,) * (x.ndim - 1))  # (B,) -> (B, 1, 1, 1), or (B, 1, 1, 1, 1) for video
        z_t = (1 - t4) * x + t4 * noise
        v = net(z_t, t, labels)
        return ((noise - x) - v) ** 2


def flow_times(num_steps: int = 50, shift: float = 1.0, device=None) -> torch.Tensor:
    """Time grid from t = 1 down to 0: shape (N+1,), float64.

    Uniform in t, then optionally shifted as in SD3, t' = shift t / (1 + (shift - 1) t): shift > 1 spends
    more steps at high noise, shift = 1 leaves the grid uniform (rf.py's equal steps).
    """
    if shift <= 0:
        raise ValueError(f"objective.shift must be positive, got {shift}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64, device=device)
    return shift_time(t, shift)


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's time shift t' = shift t / (1 + (shift - 1) t), which keeps 0 and 1 and moves the rest towards noise for
    shift > 1. Flux's resolution-dependent shift is this with shift = exp(mu), mu growing with the image tokens."""
    return shift * t / (1 + (shift - 1) * t)


def _velocity(model, z, t, extra_args):
    # The ODE state is integrated in float64 (as the EDM samplers do); the network runs in float32.
    return model(z.float(), t.expand(z.shape[0]).float(), **extra_args).to(torch.float64)


@torch.no_grad()
def sample_flow_euler(model, x, ts, extra_args=None, callback=None, disable: bool = True) -> torch.Tensor:
    """Euler on dz/dt = v from ts[0] = 1 down to ts[-1] = 0; `x` starts as pure noise. N evaluations."""
    extra_args = extra_args or {}
    z = x.to(torch.float64)
    for i in tqdm(range(len(ts) - 1), disable=disable, desc="sampling"):
        t_cur, t_next = ts[i], ts[i + 1]
        # Euler step.
        z = z + (t_next - t_cur) * _velocity(model, z, t_cur, extra_args)
        if callback is not None:
            callback({"x": z, "i": i, "sigma": t_cur, "sigma_hat": t_cur})
    return z


@torch.no_grad()
def sample_flow_heun(model, x, ts, extra_args=None, callback=None, disable: bool = True) -> torch.Tensor:
    """Euler step then trapezoidal (Heun) correction at every step, t = 0 included. 2N evaluations.

    Unlike EDM's d = (x - D) / sigma, the velocity stays defined at t = 0, so the last step is corrected too.
    """
    extra_args = extra_args or {}
    z = x.to(torch.float64)
    for i in tqdm(range(len(ts) - 1), disable=disable, desc="sampling"):
        t_cur, t_next = ts[i], ts[i + 1]
        # Euler step.
        v_cur = _velocity(model, z, t_cur, extra_args)
        z_next = z + (t_next - t_cur) * v_cur
        # Apply 2nd order correction.
        v_prime = _velocity(model, z_next, t_next, extra_args)
        z = z + (t_next - t_cur) * (0.5 * v_cur + 0.5 * v_prime)
        if callback is not None:
            callback({"x": z, "i": i, "sigma": t_cur, "sigma_hat": t_cur})
    return z


FLOW_SAMPLERS = {"euler": sample_flow_euler, "heun": sample_flow_heun}
