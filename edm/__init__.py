"""Objectives (EDM, rectified flow): preconditioning, losses, time distributions, samplers, guidance.

Wraps any F(x, c_noise, labels); knows nothing of backbones or routing.
"""

from edm.flow import FLOW_SAMPLERS, FlowLoss, FlowModel, LogitNormalTime, UniformTime, flow_times, sample_flow_euler, sample_flow_heun, shift_time
from edm.generate import generate
from edm.guidance import CFGDenoiser, PathDropGuidance, RoutingGuidance, with_path_drop_guidance, with_routing_guidance
from edm.loss import EDMLoss, LogNormalSigma, reduce_loss
from edm.objectives import EDM, OBJECTIVES, Flow, Objective, build_objective
from edm.precond import EDMPrecond, edm_coefficients
from edm.sampler import SAMPLERS, edm_sigmas, sample_euler, sample_heun

__all__ = [
    "CFGDenoiser", "EDM", "EDMLoss", "EDMPrecond", "FLOW_SAMPLERS", "Flow", "FlowLoss", "FlowModel", "LogNormalSigma",
    "LogitNormalTime", "OBJECTIVES", "Objective", "PathDropGuidance", "RoutingGuidance", "SAMPLERS", "UniformTime", "build_objective",
    "edm_coefficients", "edm_sigmas", "flow_times", "generate", "reduce_loss", "sample_euler", "sample_flow_euler",
    "sample_flow_heun", "sample_heun", "shift_time", "with_path_drop_guidance", "with_routing_guidance",
]
