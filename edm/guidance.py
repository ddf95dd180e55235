"""Classifier-free guidance: D = D_u + w (D_c - D_u), with the null class as the unconditional label."""

from __future__ import annotations

import torch
from torch import nn


class CFGDenoiser(nn.Module):
    def __init__(self, net: nn.Module, guidance_scale: float, null_label: int):
        super().__init__()
        self.net, self.w, self.null_label = net, guidance_scale, null_label

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        if class_labels is None or self.w == 1.0:
            return self.net(x, sigma, class_labels)
        null = torch.full_like(class_labels, self.null_label)
        # One batched call for both branches: (2B, ...).
        D = self.net(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([class_labels, null]))
        D_c, D_u = D.chunk(2)
        return D_u + self.w * (D_c - D_u)
