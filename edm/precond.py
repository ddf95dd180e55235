"""EDM preconditioning (Karras et al. 2022, Table 1): D(x; sigma) = c_skip x + c_out F(c_in x; c_noise).

Wraps any network F(x, c_noise, class_labels); it knows nothing of the backbone.
"""

from __future__ import annotations

import torch
from torch import nn


def edm_coefficients(sigma: torch.Tensor, sigma_data: float) -> tuple[torch.Tensor, ...]:
    """c_skip, c_out, c_in, c_noise for noise levels sigma (any shape)."""
    s2, sd2 = sigma**2, sigma_data**2
    c_skip = sd2 / (s2 + sd2)
    c_out = sigma * sigma_data / (s2 + sd2).sqrt()
    c_in = 1 / (s2 + sd2).sqrt()
    c_noise = sigma.log() / 4
    return c_skip, c_out, c_in, c_noise


class EDMPrecond(nn.Module):
    def __init__(self, model: nn.Module, sigma_data: float = 0.5):
        super().__init__()
        if sigma_data <= 0:
            raise ValueError(f"sigma_data must be positive, got {sigma_data}")
        self.model = model
        self.sigma_data = sigma_data

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        sigma = sigma.float().reshape(-1, 1, 1, 1).expand(x.shape[0], 1, 1, 1)  # (B,) or () -> (B, 1, 1, 1)
        c_skip, c_out, c_in, c_noise = edm_coefficients(sigma, self.sigma_data)
        F_x = self.model(c_in * x, c_noise.flatten(), class_labels)
        return c_skip * x + c_out * F_x.float()
