"""EDM (Karras et al. 2022): preconditioning, loss, samplers, guidance. Wraps any F(x, c_noise, labels)."""

from edm.guidance import CFGDenoiser
from edm.loss import EDMLoss, LogNormalSigma, reduce_loss
from edm.precond import EDMPrecond, edm_coefficients
from edm.sampler import SAMPLERS, edm_sigmas, sample_euler, sample_heun

__all__ = [
    "CFGDenoiser", "EDMLoss", "EDMPrecond", "LogNormalSigma", "SAMPLERS",
    "edm_coefficients", "edm_sigmas", "reduce_loss", "sample_euler", "sample_heun",
]
