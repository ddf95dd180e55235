"""FID: Inception-v3 pool3 features of generated or real images against reference statistics.

Samples are generated in global batches of `batch_size`; batch b uses seed `seed + b` and
class labels (b * batch_size + i) % num_classes (balanced classes), and process r of W
handles the batches b with b % W == r, so the sample set does not depend on the number of
processes. Features are gathered to every process; the trainer and `python -m train.fid` both
call from every process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from backbones.diffmoe import set_inference_capacity
from edm import Objective, generate, with_path_drop_guidance, with_routing_guidance
from routing.errors import ConfigError
from train.data.captions import UNREADABLE
from train.data.images import image_files, load_image
from train.metrics.frechet import feature_statistics, frechet_distance
from train.files import read_reference
from train.metrics.inception import FEATURE_DIMS, inception_features, load_inception, resolve_weights


@dataclass
class FIDConfig:
    """Settings of one FID evaluation (the trainer's `fid:` config block has these keys)."""

    ref: str  # reference statistics: an .npz with `mu` and `sigma` (ADM layout), or a folder of real images
    num_samples: int = 10_000
    steps: int = 40
    guidance: float = 1.0
    sampler: str = "heun"
    batch_size: int = 64  # samples per global batch; also the Inception batch
    seed: int = 0
    inception: str | None = None  # local weights file; None: torch hub's checkpoints folder
    route_ratio: float = 0.0  # routed inference: routing forced at this ratio over the trained routes (0 = off)
    rg_scale: float = 1.0  # routing guidance w (1 = off): D(gamma_2) + w (D(gamma_1) - D(gamma_2))
    rg_gamma1: float | None = None  # strong branch's ratio (None: unrouted)
    rg_gamma2: float = 0.5  # weak branch's ratio
    rg_uncond: bool = False  # both branches unconditional (the released sample_tread)
    pdg_scale: float = 1.0  # SPRINT's path-drop guidance w (1 = off); replaces CFG's unconditional branch
    moe_threshold: float | None = None  # DiffMoE: one capacity-predictor threshold for every expert
    moe_target: float | None = None  # DiffMoE: average activated experts per token (None, None: learned thresholds)


def fid_config(cfg_fid: Any) -> FIDConfig:
    """FIDConfig from a DictConfig / dict (unknown keys, such as the trainer's `every`, are ignored)."""
    from omegaconf import DictConfig, OmegaConf

    values = OmegaConf.to_container(cfg_fid, resolve=True) if isinstance(cfg_fid, DictConfig) else dict(cfg_fid)
    if not values.get("ref"):
        raise ConfigError("fid.ref is not set: pass fid.ref=/path/to/ref.npz (mu, sigma) or a folder of real images.")
    return FIDConfig(**{f.name: values[f.name] for f in fields(FIDConfig) if f.name in values})


def _gather_in_order(accelerator, indices: torch.Tensor, features: torch.Tensor, total: int) -> torch.Tensor:
    """Rows (m, d) with global row ids (m,) on each process -> all rows (total, d) in id order, on every process."""
    indices = accelerator.pad_across_processes(indices.to(accelerator.device), dim=0, pad_index=-1)
    features = accelerator.pad_across_processes(features.to(accelerator.device), dim=0)
    indices, features = accelerator.gather(indices).cpu(), accelerator.gather(features).cpu()
    keep = indices >= 0
    ordered = torch.empty(total, features.shape[1], dtype=features.dtype)
    ordered[indices[keep]] = features[keep]
    return ordered


def _fid_images(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise ConfigError(f"{str(folder)!r} is not a folder of images.")
    files = image_files(folder)
    if len(files) < 2:
        raise ConfigError(f"{str(folder)!r} holds {len(files)} images; FID needs at least 2.")
    return files


def _read_image(file: Path, size: int | None) -> torch.Tensor:
    """An image of a scored folder; one that cannot be decoded is named, as the data loaders name theirs."""
    try:
        return load_image(file, size)
    except UNREADABLE as err:
        if isinstance(err, OSError) and err.errno is not None:
            raise  # the file system's fault (permissions, a full disk): the command names it with its own fix
        raise ConfigError(f"image '{file}' is unreadable ({type(err).__name__}); replace or delete it.") from None


def folder_features(folder: Path, extractor, accelerator, batch_size: int, size: int | None = None) -> torch.Tensor:
    """Inception features (n, 2048) of every image in a folder, split across processes."""
    files = _fid_images(folder)
    mine = list(range(accelerator.process_index, len(files), accelerator.num_processes))
    features = []
    for start in tqdm(range(0, len(mine), batch_size), desc="real", disable=not accelerator.is_main_process):
        images = [_read_image(files[i], size) for i in mine[start : start + batch_size]]
        if len({tuple(image.shape) for image in images}) > 1:
            raise ConfigError(f"images in {str(folder)!r} differ in size: pass --size N to centre-crop them to N x N.")
        features.append(inception_features(extractor, torch.stack(images), batch_size))
    local = torch.cat(features) if features else torch.zeros(0, 2048)
    return _gather_in_order(accelerator, torch.tensor(mine, dtype=torch.long), local, len(files))


def reference_statistics(ref: str, extractor, accelerator, batch_size: int, size: int | None = None):
    """(mu, sigma) from an npz (ADM's keys `mu`, `sigma`, checked: train/files/fid_reference.py) or from the images of a folder."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return feature_statistics(folder_features(path, extractor, accelerator, batch_size, size))
    return read_reference(path, FEATURE_DIMS)


def check_reference(ref: str, inception: str | None = None) -> None:
    """Refuse, before any sample is drawn, a reference that cannot be used (a damaged .npz, the wrong size, NaN
    statistics, a folder with fewer than 2 images) and Inception weights that are missing or not a weights file."""
    path = Path(str(ref)).expanduser()
    _fid_images(path) if path.is_dir() else read_reference(path, FEATURE_DIMS)
    resolve_weights(inception)


def sample_features(net, dataset, cfg: FIDConfig, accelerator, extractor, objective: Objective | None = None) -> torch.Tensor:
    """Inception features (num_samples, 2048) of generated images, gathered to every process."""
    router = getattr(getattr(net, "model", None), "router", None)  # None: a network without TREAD routing
    if cfg.moe_threshold is not None or cfg.moe_target is not None:
        set_inference_capacity(net, threshold=cfg.moe_threshold, target=cfg.moe_target)
    sampled = with_routing_guidance(net, router, cfg.rg_scale, cfg.rg_gamma1, cfg.rg_gamma2, unconditional=cfg.rg_uncond,
                                    null_label=dataset.num_classes)
    sampled = with_path_drop_guidance(sampled, router, cfg.pdg_scale, dataset.num_classes)
    num_batches = math.ceil(cfg.num_samples / cfg.batch_size)
    mine = range(accelerator.process_index, num_batches, accelerator.num_processes)
    indices, features = [], []
    for b in tqdm(mine, desc="fid samples", disable=not accelerator.is_main_process):
        ids = torch.arange(b * cfg.batch_size, min((b + 1) * cfg.batch_size, cfg.num_samples))
        labels = ids % max(dataset.num_classes, 1)
        x = generate(sampled, labels, shape=tuple(dataset.shape), steps=cfg.steps, guidance=cfg.guidance, seed=cfg.seed + b,
                     device=accelerator.device, sampler=cfg.sampler, null_label=dataset.num_classes, objective=objective,
                     router=router, route_ratio=cfg.route_ratio)
        features.append(inception_features(extractor, dataset.to_images(x), cfg.batch_size))
        indices.append(ids)
    local_ids = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.long)
    local = torch.cat(features) if features else torch.zeros(0, 2048, device=accelerator.device)
    return _gather_in_order(accelerator, local_ids, local, cfg.num_samples)


def compute_fid(net, dataset, cfg_fid: Any, accelerator, objective: Objective | None = None) -> float:
    """FID of `net` (the objective's network, eval mode, on accelerator.device) against cfg_fid.ref; call on every process."""
    cfg = fid_config(cfg_fid)
    extractor = load_inception(cfg.inception, accelerator.device)
    mu_ref, sigma_ref = _cached_reference(cfg.ref, extractor, accelerator, cfg.batch_size)  # a bad reference fails first
    generated = sample_features(net, dataset, cfg, accelerator, extractor, objective)
    return frechet_distance(*feature_statistics(generated), mu_ref, sigma_ref)


_REFERENCE_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _cached_reference(ref: str, extractor, accelerator, batch_size: int):
    # Periodic FID during training reuses the reference statistics instead of re-reading a folder every time.
    if ref not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[ref] = reference_statistics(ref, extractor, accelerator, batch_size)
    return _REFERENCE_CACHE[ref]


