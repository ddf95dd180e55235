"""Quality of every cell: the real Trainer for an equal budget, then the EMA model's loss and classifier scores,
at the end of the budget and against optimizer steps (the checkpoints the trainer wrote on the way)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import statistics
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

from backbones.diffmoe import activated_parameters, moe_layers
from edm import generate
from train.bench.cells import Cell
from train.bench.moe import LoadRecorder
from train.bench.timing import now, training_step
from train.build import build_backbone_for, objective_for
from train.checkpoint import latest_checkpoint
from train.data import build_dataset
from train.grid import grid_labels, save_grid
from train.metrics.classifier import SmallCNN, features, sample_scores
from train.metrics.heldout import HeldOutReference
from train.schema import resume_changes
from train.trainer import Trainer

STALL = 2.0  # a training step slower than STALL x the cell's median step was slowed down by something else


class Evaluation:
    """What every cell is scored against, fixed once per bench: a loss batch, sample labels, a classifier.

    With a test split (data.split) the loss batch and the FD reference are test images and the floor is
    train images against them (train/metrics/heldout.py); otherwise as described in `reference_images`.
    """

    def __init__(self, bench: DictConfig, cfg: DictConfig, dataset, classifier: SmallCNN, test=None):
        e = bench.eval
        self.cfg, self.dataset, self.classifier = e, dataset, classifier
        self.device = torch.device(bench.device)
        reference, self.reference = (test, f"held out: the {len(test):,} {test.name} images") if test is not None \
            else reference_images(cfg, dataset)
        g = torch.Generator().manual_seed(e.seed)
        order = torch.randperm(len(reference), generator=g)
        # Loss batch: clean images, labels, noise levels and noise drawn once, identical for every cell. The
        # objective (edm or flow, from `overrides`) is the same for every cell of a bench, so its loss is too.
        n = min(e.batch, len(reference))
        self.objective = objective_for(cfg)
        self.y, self.labels = reference.get(order[:n])
        self.t = self.objective.sample_time(n, g)  # EDM: sigma; flow: t
        self.noise = torch.randn(n, *dataset.shape, generator=g)
        self.sample_labels = grid_labels(dataset.num_classes, e.per_class)
        if test is not None:
            held_out = HeldOutReference(classifier, test, dataset, e.num_real, len(self.sample_labels), e.seed)
            self.real_features, self.real_scores = held_out.real_features, held_out.floor
            self.floor = f"{len(self.sample_labels)} train images against the same test reference"
            return
        num_real = min(e.num_real, len(reference))
        real, _ = reference.get(order[:num_real])
        self.real_features = features(classifier, real)
        # The scores of as many other real images as there are samples: the best a model can reach at this size.
        others = order[num_real:] if len(reference) - num_real >= len(self.sample_labels) else order
        images, labels = reference.get(others[: len(self.sample_labels)])
        self.real_scores = sample_scores(classifier, images, labels, self.real_features)
        self.floor = f"{len(self.sample_labels)} other real images"

    @torch.no_grad()
    def loss(self, net: nn.Module) -> float:
        """The objective's loss of `net` (eval mode: no routing) on the fixed batch with fixed noise levels and noise."""
        net.eval()
        d = self.device
        return self.objective.loss(net, self.y.to(d), self.labels.to(d), self.t.to(d), self.noise.to(d)).mean().item()

    @torch.no_grad()
    def score(self, net: nn.Module) -> tuple[dict[str, float], torch.Tensor]:
        """EMA loss, classifier-FD and class accuracy of `net` (eval mode: no routing), and its samples.

        A network with MoE layers also reports the experts a token activates while sampling (DiffMoE's dynamic
        capacity at inference) and the parameters that makes per token.
        """
        loss = self.loss(net)
        sampled = LoadRecorder(net) if moe_layers(net) else net
        samples = generate(sampled, self.sample_labels, shape=self.dataset.shape, steps=self.cfg.steps, guidance=self.cfg.guidance,
                           seed=self.cfg.seed, device=self.device, null_label=self.dataset.num_classes,
                           objective=self.objective, progress=True).cpu()  # minutes for a scan model on a CPU
        scores = {"ema_loss": loss, **sample_scores(self.classifier, samples, self.sample_labels, self.real_features)}
        if sampled is not net:
            experts = torch.stack(sampled.loads).mean().item()  # over evaluations, samples, MoE layers and tokens
            scores |= {"experts_per_token_inference": experts, "activated_params_inference": activated_parameters(net, experts)}
        return scores, samples


def reference_images(cfg: DictConfig, dataset):
    """Real images for the loss batch and the FD reference of a dataset without a test split.

    Procedural data (a `seed` key) is drawn again with another seed, so the images are unseen; a fixed set
    such as digits has no held-out split, so its training images are used.
    """
    if "seed" in cfg.data:
        held_out = cfg.data.copy()
        held_out.seed = cfg.data.seed + 1
        return build_dataset(held_out, cfg.edm.sigma_data), f"held out: {cfg.data.name} drawn with seed {held_out.seed}"
    return dataset, f"training images: {cfg.data.name} has no held-out split"


def held_out_split(cfg: DictConfig, sigma_data: float):
    """The test split of a dataset that has one (a `split` key), else None."""
    if "split" not in cfg.data:
        return None
    held_out = cfg.data.copy()
    held_out.split = "test"
    return build_dataset(held_out, sigma_data)


def warm_up(pairs: list[Cell], shape: tuple[int, ...], num_classes: int, bench: DictConfig) -> None:
    """One untimed training step of every pair at the training shape, before any budget starts.

    The first step at a new shape pays one-off costs (kernel selection, allocator growth; about 7 s for
    Mamba's scan on a CPU). Without this the first cell of each backbone, the unrouted one, would pay them
    out of its budget and the others would not.
    """
    device = torch.device(bench.device)
    for cell in tqdm(pairs, desc="quality: warm-up", dynamic_ncols=True):
        objective = objective_for(cell.cfg)
        net = objective.wrap(build_backbone_for(cell.cfg, shape, num_classes)).to(device).train()
        training_step(net, bench.train.batch_size, shape, num_classes, device, seed=cell.seed, objective=objective)()


def train_and_score(cell: Cell, evaluation: Evaluation, out: Path) -> dict:
    """Train one cell for the budget with the real Trainer, then score its EMA model."""
    run_dir = Path(cell.cfg.run_dir)
    resumed_at = interrupted_step(cell.cfg)
    if resumed_at is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        cell.cfg.resume = "auto"  # resume is exact (tests/test_resume.py), so the cell trains the same model
    trainer = Trainer(cell.cfg)
    trainer.fit()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if resumed_at is not None:
        # The resumed process counts seconds from zero; continue the clock of the interrupted one.
        offset = next(m["seconds"] for m in reversed(metrics) if m["step"] <= resumed_at)
        for m in metrics:
            m["seconds"] += offset if m["step"] > resumed_at else 0.0
    scores, samples = evaluation.score(trainer.ema.module)
    save_grid(evaluation.dataset.to_images(samples), out / "samples" / f"{cell.name}.png", per_row=evaluation.cfg.per_class)
    seconds = metrics[-1]["seconds"]
    at_step = (evaluation.cfg.get("at_steps") or {}).get(cell.backbone)
    return {
        **scores, **score_checkpoints(trainer.ema.module, run_dir / "checkpoints", evaluation, metrics, at_step,
                                      final=(trainer.step, scores)),
        "cell": cell.name, "backbone": cell.backbone, "routing": cell.routing, "seed": cell.seed,
        "train_steps": trainer.step, "train_seconds": seconds, "stalled_seconds": stalled_seconds([m["seconds"] for m in metrics]),
        "images_per_s": trainer.step * cell.cfg.trainer.batch_size / seconds,
        "curve": {key: [m[key] for m in metrics] for key in ("step", "seconds", "loss")},
        "resumed_at_step": resumed_at, "date": now(), "load_average": os.getloadavg(),
    }


def interrupted_step(cfg: DictConfig) -> int | None:
    """The step of the latest checkpoint a killed attempt of this very cell left, when it can be continued.

    A step budget can be continued from a checkpoint; a wall-clock budget (trainer.max_minutes) cannot, since
    the time before the kill is not comparable, so that attempt restarts and the budget stays one whole run.
    """
    run_dir = Path(cfg.run_dir)
    latest = latest_checkpoint(run_dir / "checkpoints")
    if cfg.trainer.get("max_minutes") or latest is None or not (run_dir / "config.yaml").exists():
        return None
    refused, applied = resume_changes(OmegaConf.load(run_dir / "config.yaml"), cfg)
    return None if refused or applied else int(latest.name.removeprefix("step_"))


def score_checkpoints(ema: nn.Module, root: Path, evaluation: Evaluation, metrics: list[dict], at_step: int | None,
                      final: tuple[int, dict] | None = None) -> dict:
    """Quality against optimizer steps: the held-out EMA loss of every checkpoint the trainer wrote (every
    `eval.every` steps), and the full sample scores at `at_step`, a step count every cell of the backbone
    reaches, so routed and unrouted cells are also compared after the same number of updates.

    The checkpoints are deleted afterwards (a grid of cells would otherwise keep gigabytes of optimizer state),
    except the final one with `eval.keep_final`, so the run folder can be sampled again (train.sample,
    train.bench.sampling).
    """
    seconds = {m["step"]: m["seconds"] for m in metrics}
    net = copy.deepcopy(ema)
    curve = {"step": [], "seconds": [], "ema_loss": []}
    at = {"at_step": at_step, "at_step_ema_loss": None, "at_step_classifier_fd": None, "at_step_class_accuracy": None}
    for ckpt in tqdm(sorted(root.glob("step_*")), desc="quality: checkpoints", leave=False, dynamic_ncols=True):
        step = int(ckpt.name.removeprefix("step_"))
        net.load_state_dict(load_file(str(ckpt / "ema.safetensors")))
        curve["step"].append(step)
        curve["seconds"].append(seconds.get(step))
        if step == at_step:
            # The unrouted cell ends at its matched step: its final scores are the same model's, so reuse them.
            scores = final[1] if final and final[0] == step else evaluation.score(net)[0]
            at.update({f"at_step_{k}": v for k, v in scores.items()})
            curve["ema_loss"].append(scores["ema_loss"])
        else:
            curve["ema_loss"].append(evaluation.loss(net))
    keep = final[0] if final is not None and evaluation.cfg.get("keep_final") else None
    for ckpt in root.glob("step_*"):
        if int(ckpt.name.removeprefix("step_")) != keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    if keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return {"quality_curve": curve, **at}


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
