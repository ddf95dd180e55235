"""Fréchet distance between Gaussians fitted to feature sets (the FID formula).

FID (Heusel et al. 2017) fits N(mu, Sigma) to two sets of features and measures

    d^2 = ||mu1 - mu2||^2 + tr(Sigma1 + Sigma2 - 2 (Sigma1 Sigma2)^(1/2)).

The trace of the matrix square root is computed through a symmetric eigenproblem instead of
scipy.linalg.sqrtm: with A = Sigma1^(1/2) (PSD), Sigma1 Sigma2 is similar to A Sigma2 A, which is
symmetric PSD, so tr((Sigma1 Sigma2)^(1/2)) = sum sqrt(eig(A Sigma2 A)). Eigenvalues are clipped
at 0, so rounding never yields complex numbers or NaNs, even for singular covariances (fewer
samples than feature dimensions). Everything runs in float64 torch on the CPU: one BLAS thread
pool only, because numpy's OpenBLAS threads spinning next to torch's OpenMP threads made the
2048 x 2048 eigenproblems up to 10x slower on a 2-core machine.
"""

from __future__ import annotations

import numpy as np
import torch


def feature_statistics(features: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Mean (d,) and unbiased covariance (d, d) of features (n, d), in float64."""
    features = _float64(features)
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"feature_statistics needs features of shape (n >= 2, d), got {tuple(features.shape)}.")
    mu = features.mean(dim=0)
    centred = features - mu
    sigma = centred.T @ centred / (features.shape[0] - 1)
    return mu.numpy(), sigma.numpy()


def _float64(array: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array.detach().cpu().double()
    return torch.from_numpy(np.asarray(array, dtype=np.float64))


def _sqrt_psd(matrix: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a symmetric PSD matrix via its eigendecomposition."""
    eigenvalues, eigenvectors = torch.linalg.eigh((matrix + matrix.T) / 2)
    return (eigenvectors * eigenvalues.clamp(min=0).sqrt()) @ eigenvectors.T


def frechet_distance(
    mu1: np.ndarray | torch.Tensor, sigma1: np.ndarray | torch.Tensor, mu2: np.ndarray | torch.Tensor, sigma2: np.ndarray | torch.Tensor
) -> float:
    """Squared Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2)."""
    mu1, mu2 = _float64(mu1).reshape(-1), _float64(mu2).reshape(-1)  # any shape -> (d,)
    sigma1, sigma2 = torch.atleast_2d(_float64(sigma1)), torch.atleast_2d(_float64(sigma2))
    d = mu1.numel()
    if mu2.shape != mu1.shape or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise ValueError(
            f"Statistics do not match: mu {tuple(mu1.shape)} vs {tuple(mu2.shape)}, "
            f"sigma {tuple(sigma1.shape)} vs {tuple(sigma2.shape)}."
        )

    # Trace of (Sigma1 Sigma2)^(1/2) from the similar symmetric matrix A Sigma2 A.
    a = _sqrt_psd(sigma1)
    product = a @ sigma2 @ a
    eigenvalues = torch.linalg.eigvalsh((product + product.T) / 2)
    trace_sqrt = eigenvalues.clamp(min=0).sqrt().sum()

    mean_term = (mu1 - mu2).square().sum()
    scale = float(sigma1.trace() + sigma2.trace())
    distance = float(mean_term + scale - 2.0 * trace_sqrt)
    # The distance is >= 0. Rounding takes it below: each of the d eigenvalues that are 0 in exact arithmetic comes
    # out as +-eps x the largest, whose square root adds up to sqrt(eps) x the traces (identical folders of 3 images:
    # -2e-6 x the traces, printed FID -0.0000). Within that bound it is 0 (and -0.0 is 0); further below, the sign of
    # statistics that are no covariances, it stays.
    rounding = d * float(np.finfo(np.float64).eps) ** 0.5 * abs(scale)
    return 0.0 if -rounding <= distance <= 0 else distance
