"""Offline sample-quality scorer: a small CNN classifier trained once on an embedded dataset.

Inception FID needs downloaded weights and natural images; the embedded datasets (digits, shapes) and
Fashion-MNIST are neither. So the benchmark trains this classifier once per dataset (fixed seed, cached as
safetensors keyed by dataset name and resolution) and scores class-conditional samples with it. A dataset
with a test split (Fashion-MNIST) trains it on the train split and reports its accuracy on the test split;
the others hold out a fixed fraction of their images.

- classifier-FD: the Fréchet distance (train/metrics/frechet.py) between Gaussians fitted to the classifier's
  penultimate features of generated and of real images. It is FID's formula on other features, so its
  numbers are comparable only with other classifier-FDs from the same classifier; it is NOT Inception FID.
- class accuracy: how often the classifier recognises the class a sample was asked for.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from train.files import damaged, read_tensors, safetensors_metadata
from train.metrics.frechet import feature_statistics, frechet_distance


@dataclass
class ClassifierConfig:
    width: int = 32
    feature_dim: int = 64
    epochs: int = 15
    batch_size: int = 64
    lr: float = 2e-3
    holdout: float = 0.1  # fraction kept out of training for the classifier's own accuracy (no test split given)
    max_images: int | None = None  # train on a fixed random subset of this many images (CPU time on 60,000)
    seed: int = 0


class SmallCNN(nn.Module):
    """Two conv stages with pooling, global average pool to `feature_dim` features, linear class head."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, feature_dim: int = 64):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, feature_dim, 3, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),  # (B, feature_dim, h, w) -> (B, feature_dim)
        )
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate features (B, feature_dim) of images in model space ([-1, 1])."""
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _split(n: int, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out indices of a fixed permutation; at least one held-out image."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(n * holdout))
    return perm[n_val:], perm[:n_val]


@torch.no_grad()
def accuracy(model: SmallCNN, images: torch.Tensor, labels: torch.Tensor, batch: int = 512) -> float:
    model.eval()
    correct = sum((model(images[i:i + batch]).argmax(-1) == labels[i:i + batch]).sum().item() for i in range(0, len(images), batch))
    return correct / len(images)


def train_classifier(dataset, cfg: ClassifierConfig, test=None) -> tuple[SmallCNN, float]:
    """Train on `dataset` and return the model and its held-out accuracy: on `test` (a test split) when
    given, else on a fixed `holdout` fraction of `dataset` kept out of training."""
    g = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # weight initialisation
    model = SmallCNN(dataset.shape[0], dataset.num_classes, cfg.width, cfg.feature_dim)
    if test is None:
        train_idx, val_idx = _split(len(dataset), cfg.holdout, cfg.seed)
    else:
        train_idx = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.seed))
    if cfg.max_images:
        train_idx = train_idx[: cfg.max_images]
    images, labels = dataset.get(torch.arange(len(dataset)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    steps = cfg.epochs * -(-len(train_idx) // cfg.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, cfg.lr, total_steps=steps)
    bar = tqdm(total=steps, desc=f"classifier for {dataset.name} ({cfg.epochs} epochs, once; then cached)", dynamic_ncols=True)
    for _ in range(cfg.epochs):
        model.train()
        for batch in train_idx[torch.randperm(len(train_idx), generator=g)].split(cfg.batch_size):
            x = images[batch]
            # Noise augmentation: generated samples are rarely clean, and a classifier that has only seen
            # clean images reads slight noise as a different class.
            x = x + 0.1 * torch.rand(len(x), 1, 1, 1, generator=g) * torch.randn(x.shape, generator=g)
            loss = F.cross_entropy(model(x), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    if test is not None:
        return model.eval(), accuracy(model, *test.get(torch.arange(len(test))))
    return model.eval(), accuracy(model, images[val_idx], labels[val_idx])


def cache_path(cache_dir: str | Path, dataset) -> Path:
    """One file per dataset name and resolution."""
    return Path(os.path.expanduser(str(cache_dir))) / f"classifier-{dataset.name}-{dataset.shape[-1]}px.safetensors"


RETRAIN = "delete it, and the classifier is trained again"


def _cached_info(path: Path) -> dict:
    """What a cached classifier was trained on (its `info` metadata); a damaged cache file is refused, naming it."""
    info = safetensors_metadata(path, RETRAIN).get("info")
    try:
        meta = json.loads(info) if info is not None else None
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), (dict, type(None))):
        raise damaged(path, "has no readable 'info' metadata (what the classifier was trained on)", RETRAIN)
    return meta


def load_or_train(dataset, cfg: ClassifierConfig | None, cache_dir: str | Path, test=None) -> tuple[SmallCNN, dict]:
    """The cached classifier for `dataset` (accuracy measured on `test` when given), trained (and cached
    atomically) when missing or trained differently.

    cfg=None takes the cached classifier of this dataset whatever its settings (so a sampling study scores
    with the classifier the benchmark trained), and trains one with the default settings only when none is cached.
    """
    path = cache_path(cache_dir, dataset)
    # The metadata says what the weights were trained on; any difference means they must be retrained.
    wanted = {"config": None if cfg is None else asdict(cfg), "dataset": dataset.name, "shape": list(dataset.shape),
              "size": len(dataset), "num_classes": dataset.num_classes,
              "accuracy_on": "holdout" if test is None else f"{test.name} ({len(test)} images)"}
    if path.exists():
        meta = _cached_info(path)
        if cfg is None:
            wanted["config"] = meta.get("config")
        if {k: meta.get(k) for k in wanted} == wanted:
            saved = ClassifierConfig(**meta["config"])
            model = SmallCNN(dataset.shape[0], dataset.num_classes, saved.width, saved.feature_dim)
            model.load_state_dict(read_tensors(path, RETRAIN))
            return model.eval(), meta
    cfg = cfg if cfg is not None else ClassifierConfig()
    wanted["config"] = asdict(cfg)
    model, val_accuracy = train_classifier(dataset, cfg, test)
    meta = {**wanted, "heldout_accuracy": val_accuracy}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(model.state_dict(), str(tmp), metadata={"info": json.dumps(meta)})
    os.replace(tmp, path)  # atomic: a concurrent or killed run never sees half a file
    return model, meta


@torch.no_grad()
def features(model: SmallCNN, images: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """Penultimate features (n, feature_dim) of images (n, C, H, W) in model space."""
    model.eval()
    return torch.cat([model.features(images[i:i + batch].float().clamp(-1, 1)) for i in range(0, len(images), batch)])


@torch.no_grad()
def sample_scores(model: SmallCNN, samples: torch.Tensor, labels: torch.Tensor, real_features: torch.Tensor) -> dict[str, float]:
    """classifier-FD of samples against real features, and the accuracy on the requested labels."""
    fake = features(model, samples)
    mu_f, sigma_f = feature_statistics(fake)
    mu_r, sigma_r = feature_statistics(real_features)
    predicted = model.head(fake).argmax(-1)
    return {"classifier_fd": frechet_distance(mu_f, sigma_f, mu_r, sigma_r),
            "class_accuracy": (predicted == labels.to(predicted.device)).float().mean().item()}
