"""Inception-v3 pool3 features (2048-d) for FID, with weights from a local file only.

The network is torch-fidelity's FeatureExtractorInceptionV3: a port of the TensorFlow
Inception graph the original FID code (and ADM's evaluator) use, including TF1's bilinear
resize to 299 x 299, so its features match the published reference statistics. torch-fidelity
would download the weights on first use; this machine setup has no network, so we always pass
a local path and fail with one sentence that says where to get the file and where to put it.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch

from routing.errors import ConfigError
from train.files import check_weights

WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{WEIGHTS_FILE}"
FEATURE = "2048"  # pool3, the FID layer
FEATURE_DIMS = int(FEATURE)


def default_weights_path() -> Path:
    """Where torch-fidelity's own download would land: <torch hub dir>/checkpoints/<file>."""
    return Path(torch.hub.get_dir()) / "checkpoints" / WEIGHTS_FILE


def resolve_weights(weights: str | os.PathLike | None) -> Path:
    """The weights file to use, or a ConfigError naming the download and the destination."""
    path = Path(weights).expanduser() if weights else default_weights_path()
    fix = (f"download {WEIGHTS_URL} on a machine with network and put it at {str(default_weights_path())!r} "
           "(or anywhere, passing --inception PATH / fid.inception=PATH)")
    if not path.exists():
        raise ConfigError(f"Inception weights not found at {str(path)!r}: {fix}.")
    return check_weights(path, fix)


def _extractor_class():
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    except ImportError as error:
        raise ConfigError("FID needs torch-fidelity: pip install torch-fidelity.") from error
    return FeatureExtractorInceptionV3


@lru_cache(maxsize=2)
def _load(path: str, device: str) -> torch.nn.Module:
    extractor = _extractor_class()
    try:
        model = extractor("inception-v3-compat", [FEATURE], feature_extractor_weights_path=path)
    except Exception as error:  # torch.load and load_state_dict raise many types for a damaged or foreign file
        raise ConfigError(
            f"{path!r} is not torch-fidelity's Inception-v3 weights ({type(error).__name__}); "
            f"download {WEIGHTS_URL} again."
        ) from error
    return model.to(device)


def load_inception(weights: str | os.PathLike | None = None, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The feature extractor in eval mode on `device`; cached, so periodic FID loads it once."""
    return _load(str(resolve_weights(weights).resolve()), str(torch.device(device)))


@torch.no_grad()
def inception_features(model: torch.nn.Module, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """Pool3 features (n, 2048) float32 for images (n, 3 or 1, H, W): uint8 in [0, 255] or float in [0, 1]."""
    if images.shape[1] == 1:
        # Grayscale data sets (e.g. digits): Inception takes RGB, so repeat the channel.
        images = images.expand(-1, 3, -1, -1)  # (n, 1, H, W) -> (n, 3, H, W)
    if images.dtype != torch.uint8:
        # Quantise like saving a PNG, so generated and real images go through the same path.
        images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    device = next(model.parameters()).device
    features = [model(chunk.to(device))[0] for chunk in images.split(batch_size)]
    return torch.cat(features).float()
