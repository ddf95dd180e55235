"""EDM time steps and deterministic samplers, k-diffusion style: sampler(model, x, sigmas, extra_args, callback).

`model(x, sigma, **extra_args)` is a denoiser D(x; sigma); `x` starts as noise already scaled by sigmas[0].
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm


def edm_sigmas(num_steps: int = 40, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0, device=None) -> torch.Tensor:
    """t_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) - smax^(1/rho)))^rho for i < N, and t_N = 0: shape (N+1,)."""
    i = torch.arange(num_steps, dtype=torch.float64, device=device)
    steps = (sigma_max ** (1 / rho) + i / max(num_steps - 1, 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([steps, torch.zeros(1, dtype=torch.float64, device=device)])


def _denoise(model, x, sigma, extra_args):
    # The ODE state is integrated in float64 (as EDM does); the network runs in float32.
    return model(x.float(), sigma.expand(x.shape[0]).float(), **extra_args).to(torch.float64)


@torch.no_grad()
def sample_heun(
    model,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    extra_args: dict | None = None,
    callback=None,
    disable: bool = True,
    S_churn: float = 0.0,
    S_min: float = 0.0,
    S_max: float = float("inf"),
    S_noise: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """EDM Algorithm 2: Euler step then 2nd-order (Heun) correction, except at the last step."""
    extra_args = extra_args or {}
    n = len(sigmas) - 1
    x = x.to(torch.float64)
    for i in tqdm(range(n), disable=disable, desc="sampling"):
        t_cur, t_next = sigmas[i], sigmas[i + 1]
        # Increase noise temporarily (churn).
        gamma = min(S_churn / n, math.sqrt(2) - 1) if S_min <= t_cur <= S_max else 0.0
        t_hat = t_cur + gamma * t_cur
        if gamma > 0:
            eps = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            x = x + (t_hat**2 - t_cur**2).sqrt() * S_noise * eps
        # Euler step.
        d_cur = (x - _denoise(model, x, t_hat, extra_args)) / t_hat
        x_next = x + (t_next - t_hat) * d_cur
        # Apply 2nd order correction.
        if t_next > 0:
            d_prime = (x_next - _denoise(model, x_next, t_next, extra_args)) / t_next
            x_next = x + (t_next - t_hat) * (0.5 * d_cur + 0.5 * d_prime)
        x = x_next
        if callback is not None:
            callback({"x": x, "i": i, "sigma": t_cur, "sigma_hat": t_hat})
    return x


@torch.no_grad()
def sample_euler(model, x, sigmas, extra_args=None, callback=None, disable: bool = True) -> torch.Tensor:
    """First-order Euler on the probability-flow ODE (cheap previews)."""
    extra_args = extra_args or {}
    x = x.to(torch.float64)
    for i in tqdm(range(len(sigmas) - 1), disable=disable, desc="sampling"):
        d = (x - _denoise(model, x, sigmas[i], extra_args)) / sigmas[i]
        x = x + (sigmas[i + 1] - sigmas[i]) * d
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i]})
    return x


SAMPLERS = {"heun": sample_heun, "euler": sample_euler}
