"""Fréchet distance: zero for identical sets, closed forms, and scipy's sqrtm reference."""

import numpy as np
import pytest
import scipy.linalg
import torch

from train.metrics.frechet import feature_statistics, frechet_distance


def test_statistics_match_numpy():
    features = np.random.default_rng(0).normal(size=(50, 6))
    mu, sigma = feature_statistics(torch.from_numpy(features).float())
    assert mu.dtype == np.float64 and sigma.shape == (6, 6)
    np.testing.assert_allclose(mu, features.mean(0), atol=1e-6)
    np.testing.assert_allclose(sigma, np.cov(features.T), atol=1e-5)


def test_same_set_is_zero_even_when_covariance_is_singular():
    # 20 samples in 64 dimensions: the covariance has rank 19, and the square roots of its
    # rounding-level eigenvalues leave an error of order sqrt(eps) * trace, as with scipy's sqrtm.
    features = np.random.default_rng(1).normal(size=(20, 64))
    mu, sigma = feature_statistics(features)
    assert abs(frechet_distance(mu, sigma, mu, sigma)) < 1e-6 * np.trace(sigma)
    # Full-rank case: exact to rounding.
    features = np.random.default_rng(1).normal(size=(200, 8))
    mu, sigma = feature_statistics(features)
    assert abs(frechet_distance(mu, sigma, mu, sigma)) < 1e-10


def test_diagonal_closed_form():
    rng = np.random.default_rng(2)
    mu1, mu2 = rng.normal(size=8), rng.normal(size=8)
    s1, s2 = rng.uniform(0.1, 3.0, size=8), rng.uniform(0.1, 3.0, size=8)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum(s1 + s2 - 2 * np.sqrt(s1 * s2))
    assert frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2)) == pytest.approx(expected, rel=1e-10)


def test_full_covariance_matches_scipy_sqrtm():
    rng = np.random.default_rng(3)
    d = 16
    a, b = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    sigma1, sigma2 = a @ a.T / d, b @ b.T / d + 0.1 * np.eye(d)
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    covmean = scipy.linalg.sqrtm(sigma1 @ sigma2).real
    expected = np.sum((mu1 - mu2) ** 2) + np.trace(sigma1 + sigma2 - 2 * covmean)
    assert frechet_distance(mu1, sigma1, mu2, sigma2) == pytest.approx(expected, rel=1e-8)
    # The distance is symmetric in its two arguments.
    assert frechet_distance(mu2, sigma2, mu1, sigma1) == pytest.approx(expected, rel=1e-8)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="do not match"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))
