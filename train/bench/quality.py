"""Quality of every cell: the real Trainer for an equal budget, then the EMA model's loss and classifier scores."""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from edm import EDMLoss, EDMPrecond, LogNormalSigma, generate
from train.bench.cells import Cell
from train.bench.timing import now, training_step
from train.build import build_backbone_for
from train.data import build_dataset
from train.grid import grid_labels, save_grid
from train.metrics.classifier import SmallCNN, features, sample_scores
from train.trainer import Trainer

STALL = 2.0  # a training step slower than STALL x the cell's median step was slowed down by something else


class Evaluation:
    """What every cell is scored against, fixed once per bench: a loss batch, sample labels, a classifier."""

    def __init__(self, bench: DictConfig, cfg: DictConfig, dataset, classifier: SmallCNN):
        e = bench.eval
        self.cfg, self.dataset, self.classifier = e, dataset, classifier
        self.device = torch.device(bench.device)
        reference, self.reference = reference_images(cfg, dataset)
        g = torch.Generator().manual_seed(e.seed)
        order = torch.randperm(len(reference), generator=g)
        # Loss batch: clean images, labels, sigma and noise drawn once, identical for every cell.
        n = min(e.batch, len(reference))
        self.y, self.labels = reference.get(order[:n])
        self.sigma = LogNormalSigma(cfg.edm.P_mean, cfg.edm.P_std)(n, g)
        self.noise = torch.randn(n, *dataset.shape, generator=g)
        self.loss_fn = EDMLoss(cfg.edm.sigma_data)
        num_real = min(e.num_real, len(reference))
        real, _ = reference.get(order[:num_real])
        self.real_features = features(classifier, real)
        self.sample_labels = grid_labels(dataset.num_classes, e.per_class)
        # The scores of as many other real images as there are samples: the best a model can reach at this size.
        others = order[num_real:] if len(reference) - num_real >= len(self.sample_labels) else order
        images, labels = reference.get(others[: len(self.sample_labels)])
        self.real_scores = sample_scores(classifier, images, labels, self.real_features)

    @torch.no_grad()
    def score(self, net: EDMPrecond) -> tuple[dict[str, float], torch.Tensor]:
        """EMA loss, classifier-FD and class accuracy of `net` (eval mode: no routing), and its samples."""
        net.eval()
        d = self.device
        loss = self.loss_fn(net, self.y.to(d), self.labels.to(d), self.sigma.to(d), self.noise.to(d)).mean().item()
        samples = generate(net, self.sample_labels, shape=self.dataset.shape, steps=self.cfg.steps, guidance=self.cfg.guidance,
                           seed=self.cfg.seed, device=d, null_label=self.dataset.num_classes).cpu()
        return {"ema_loss": loss, **sample_scores(self.classifier, samples, self.sample_labels, self.real_features)}, samples


def reference_images(cfg: DictConfig, dataset):
    """Real images for the loss batch and the FD reference, and how they were obtained.

    Procedural data (a `seed` key) is drawn again with another seed, so the images are unseen; a fixed set
    such as digits has no held-out split, so its training images are used.
    """
    if "seed" in cfg.data:
        held_out = cfg.data.copy()
        held_out.seed = cfg.data.seed + 1
        return build_dataset(held_out, cfg.edm.sigma_data), f"held out: {cfg.data.name} drawn with seed {held_out.seed}"
    return dataset, f"training images: {cfg.data.name} has no held-out split"


def warm_up(pairs: list[Cell], shape: tuple[int, ...], num_classes: int, bench: DictConfig) -> None:
    """One untimed training step of every pair at the training shape, before any budget starts.

    The first step at a new shape pays one-off costs (kernel selection, allocator growth; about 7 s for
    Mamba's scan on a CPU). Without this the first cell of each backbone, the unrouted one, would pay them
    out of its budget and the others would not.
    """
    device = torch.device(bench.device)
    for cell in tqdm(pairs, desc="quality: warm-up", dynamic_ncols=True):
        net = EDMPrecond(build_backbone_for(cell.cfg, shape, num_classes), cell.cfg.edm.sigma_data).to(device).train()
        training_step(net, bench.train.batch_size, shape, num_classes, device, seed=cell.seed)()


def train_and_score(cell: Cell, evaluation: Evaluation, out: Path) -> dict:
    """Train one cell for the budget with the real Trainer, then score its EMA model."""
    run_dir = Path(cell.cfg.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted attempt restarts: the budget must be one whole run
    trainer = Trainer(cell.cfg)
    trainer.fit()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    scores, samples = evaluation.score(trainer.ema.module)
    save_grid(evaluation.dataset.to_images(samples), out / "samples" / f"{cell.name}.png", per_row=evaluation.cfg.per_class)
    seconds = metrics[-1]["seconds"]
    return {
        "cell": cell.name, "backbone": cell.backbone, "routing": cell.routing, "seed": cell.seed,
        "train_steps": trainer.step, "train_seconds": seconds, "stalled_seconds": stalled_seconds([m["seconds"] for m in metrics]),
        "images_per_s": trainer.step * cell.cfg.trainer.batch_size / seconds, **scores,
        "curve": {key: [m[key] for m in metrics] for key in ("step", "seconds", "loss")},
        "date": now(), "load_average": os.getloadavg(),
    }


def stalled_seconds(elapsed: list[float]) -> float:
    """Time lost to steps slower than STALL x the median step, from cumulative seconds logged at every step.

    On a shared machine another job can stall a cell's training for seconds; that time comes out of the
    cell's wall-clock budget, so the table reports it. The first step (warm-up) is left out.
    """
    steps = [b - a for a, b in zip(elapsed, elapsed[1:])]
    if not steps:
        return 0.0
    typical = statistics.median(steps)
    return sum(max(0.0, s - STALL * typical) for s in steps)
