"""EDM training loss: lognormal noise levels, lambda(sigma) weighting, and two reductions.

The plain reduction averages over all pixels (the released TREAD code). The route-aware reduction
(first TREAD paper version) averages the loss over the tokens each route processed, then over routes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LogNormalSigma:
    """ln(sigma) ~ N(P_mean, P_std^2) (EDM Eq. 7 of TREAD's supplement)."""

    def __init__(self, P_mean: float = -1.2, P_std: float = 1.2):
        self.P_mean, self.P_std = P_mean, P_std

    def __call__(self, n: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
        rnd_normal = torch.randn(n, generator=generator, device=device)
        return (rnd_normal * self.P_std + self.P_mean).exp()


class EDMLoss:
    """Per-element weighted loss lambda(sigma) ||D(y + n; sigma) - y||^2 with n ~ N(0, sigma^2 I)."""

    def __init__(self, sigma_data: float = 0.5):
        self.sigma_data = sigma_data

    def weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2."""
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    def __call__(self, net, y: torch.Tensor, labels, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """y: clean data (B, C, H, W); sigma (B,); noise: standard normal like y. Returns (B, C, H, W)."""
        sigma4 = sigma.reshape(-1, 1, 1, 1)  # (B,) -> (B, 1, 1, 1)
        D_yn = net(y + noise * sigma4, sigma, labels)
        return self.weight(sigma4) * (D_yn - y) ** 2


def reduce_loss(loss: torch.Tensor, route_masks: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Scalar training loss from per-element loss (B, C, H, W), or (B, C, T, H, W) for video.

    With `route_masks` (one (B, h, w) bool grid of processed tokens per route; (B, t, h, w) for video) the loss is
    the mean over the pixels of processed tokens, averaged over routes; without, the plain mean.
    """
    if not route_masks:
        return loss.mean()
    per_route = []
    for mask in route_masks:
        pixels = F.interpolate(mask[:, None].float(), size=loss.shape[2:], mode="nearest")  # (B, h, w) -> (B, 1, H, W)
        per_route.append((loss * pixels).sum() / (pixels.sum() * loss.shape[1]))
    return torch.stack(per_route).mean()
