"""Cross-backbone benchmark table: cost and quality of every backbone x routing pair, measured in one run.

    python -m train.bench                   # default mode: the table in docs/benchmarks.md
    python -m train.bench bench=quick       # the whole 3 x 3 grid in under 10 minutes on 2 CPU cores
    python -m train.bench bench=smoke       # tiny everything, seconds (tests)
    python -m train.bench grid.backbones=[dit,rwkv] train.minutes=10 seeds=[0,1] name=long

Cost (cost.json): every cell's denoiser at `timing.resolution` (256 tokens by default) on random data of the
dataset's channels: parameters, forward+backward FLOPs of one training step, the FLOP-ideal speedup over the
same backbone unrouted, the measured step-time speedup (medians of steps timed round-robin over ALL cells,
so machine noise hits every cell alike), efficiency = measured / ideal, activation bytes saved for backward
and peak CUDA memory.

Quality (cells/<cell>.json): the real Trainer for an equal wall-clock budget per cell on `data`, then the
EMA model's EDM loss on a fixed batch with fixed sigma and noise, and class-conditional Heun samples scored
by train/classifier.py (classifier-FD and class accuracy; not Inception FID).

Outputs in bench_runs/<name>/: table.md, table.csv, table.json, loss_vs_time.png, bars.png,
samples/<cell>.png and runs/<cell>/ (the trainer's metrics.jsonl). cost.json and each cell JSON are written
atomically with the settings they were measured under; a re-run with the same settings reuses them.
"""

from __future__ import annotations

import csv
import datetime
import functools
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import hydra
import torch
from hydra import compose
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm.auto import tqdm

from backbones import family_module
from edm import EDMLoss, EDMPrecond, LogNormalSigma
from routing import ConfigError, build_policy
from train.bench_plots import plot_bars, plot_loss_curves
from train.build import build_backbone_for
from train.classifier import ClassifierConfig, SmallCNN, features, load_or_train, sample_scores
from train.cli import friendly_errors
from train.data import build_dataset
from train.grid import generate, grid_labels, save_grid
from train.profile import count_flops, interleaved_medians, peak_memory_bytes, saved_activation_bytes, training_step
from train.trainer import Trainer

log = logging.getLogger(__name__)

PARAM_SPREAD = 0.15  # matched size: the largest parameter count may exceed the smallest by this fraction
QUALITY = ("train_steps", "images_per_s", "stalled_seconds", "ema_loss", "classifier_fd", "class_accuracy")
STALL = 2.0  # a training step slower than STALL x the cell's median step was slowed down by something else
NOISY = 0.1  # share of a cell's budget lost to stalls above which the table flags the cell


@dataclass
class Cell:
    """One training run of the grid: a (backbone, routing) pair at one seed, with its composed config."""

    backbone: str
    routing: str
    seed: int
    cfg: DictConfig
    ablation: bool  # an unstructured subset on a scan-order backbone (TREAD's 1-D ablation)

    @property
    def key(self) -> str:
        return f"{self.backbone}-{self.routing}"

    @property
    def name(self) -> str:
        return f"{self.key}-s{self.seed}"


def is_ablation(cfg: DictConfig) -> bool:
    """True when the routing picks tokens without a grid for blocks that scan one."""
    if not cfg.routing.routes:
        return False
    policy = build_policy(cfg.routing.policy, **(cfg.routing.get("policy_kwargs") or {}))
    return family_module(cfg.backbone.name).Block.needs_grid and not policy.yields_grid


def compose_cell(bench: DictConfig, backbone: str, routing: str, seed: int) -> Cell:
    """The real training config (configs/config.yaml) for one cell, with the bench's sizes and budget."""
    try:
        cfg = compose(config_name="config", overrides=[f"backbone={backbone}", f"routing={routing}", f"data={bench.dataset}",
                                                       *bench.overrides])
    except (MissingConfigException, OverrideParseException, ConfigCompositionException) as err:
        raise ConfigError(f"{str(err).splitlines()[0]} (check grid.backbones, grid.routings, dataset and overrides).") from err
    t = bench.train
    with open_dict(cfg):
        cfg.backbone = OmegaConf.merge(cfg.backbone, bench.sizes.get(backbone) or {})
        ablation = is_ablation(cfg)
        cfg.merge_with({
            "seed": seed,
            "run_dir": str(Path(bench.out_dir) / "runs" / f"{backbone}-{routing}-s{seed}"),
            "routing": {"allow_unstructured": bool(cfg.routing.allow_unstructured or ablation)},
            "trainer": {"max_minutes": t.minutes, "max_steps": t.max_steps, "batch_size": t.batch_size,
                        "log_every": t.log_every, "sample_every": 0, "ckpt_every": 0, "cpu": bench.device == "cpu"},
        })
    return Cell(backbone, routing, seed, cfg, ablation)


# Resumable units.


def write_json_atomic(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)  # a killed run leaves the old file or the new one, never half of one


def reuse_or_compute(path: Path, settings: dict, compute: Callable[[], dict], what: str) -> dict:
    """The result saved at `path` if it was measured with exactly `settings`, else `compute()` (then saved)."""
    settings = json.loads(json.dumps(settings))  # JSON-normal form (tuples -> lists), as it is read back
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError:
            saved = {}
        if saved.get("settings") == settings:
            log.info(f"reused {what} from {path}")
            return saved
        log.info(f"{path} was measured with other settings; measuring {what} again")
    result = {"settings": settings, **compute()}
    write_json_atomic(path, result)
    return result


# Cost.


def measure_costs(pairs: list[Cell], bench: DictConfig, shape: tuple[int, ...], num_classes: int) -> dict:
    """Cost of one training step of every pair at the timing shape; step times interleaved over all pairs."""
    device, t = torch.device(bench.device), bench.timing
    steps, costs = {}, {}
    for cell in tqdm(pairs, desc="cost: FLOPs and memory", dynamic_ncols=True):
        torch.manual_seed(cell.seed)  # the same initial weights for every routing of a backbone
        model = build_backbone_for(cell.cfg, shape, num_classes)
        net = EDMPrecond(model, cell.cfg.edm.sigma_data).to(device).train()
        step = training_step(net, t.batch, shape, num_classes, device, seed=cell.seed)
        costs[cell.key] = {
            "params": sum(p.numel() for p in net.parameters()),
            "tokens": model.grid[0] * model.grid[1],
            "flops": count_flops(step),
            "saved_activation_bytes": saved_activation_bytes(step.loss, net.parameters()),
            "peak_memory_bytes": peak_memory_bytes(step, device),
        }
        steps[cell.key] = step
    with tqdm(total=len(steps) * (t.warmup + t.repeats), desc="cost: interleaved step timing", dynamic_ncols=True) as bar:
        seconds = interleaved_medians(steps, t.repeats, t.warmup, device, progress=bar.update)
    for key, s in seconds.items():
        costs[key]["step_seconds"] = s
    return {"cells": costs, "date": now(), "load_average": os.getloadavg()}


def speedups(base: dict | None, cost: dict) -> dict[str, float | None]:
    """FLOP-ideal and measured speedup of a cell over its backbone's unrouted cell, and their ratio."""
    if base is None:
        return {"ideal_speedup": None, "measured_speedup": None, "efficiency": None}
    ideal = base["flops"] / cost["flops"]
    measured = base["step_seconds"] / cost["step_seconds"]
    return {"ideal_speedup": ideal, "measured_speedup": measured, "efficiency": measured / ideal}


# Quality.


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


# Table.


def table_rows(pairs: list[Cell], costs: dict, runs: dict[str, list[dict]]) -> list[dict]:
    """One row per (backbone, routing): cost columns and quality columns averaged over seeds."""
    rows = []
    for cell in pairs:
        cost = costs[cell.key]
        quality = runs[cell.key]
        row = {
            "backbone": cell.backbone, "routing": cell.routing,
            "kind": "ablation" if cell.ablation else ("routed" if cell.cfg.routing.routes else "baseline"),
            "params": cost["params"], "tokens": cost["tokens"], "gflops_per_step": cost["flops"] / 1e9,
            **speedups(costs.get(f"{cell.backbone}-none"), cost),
            "step_ms": cost["step_seconds"] * 1e3,
            "saved_activation_mb": cost["saved_activation_bytes"] / 2**20,
            "peak_memory_mb": None if cost["peak_memory_bytes"] is None else cost["peak_memory_bytes"] / 2**20,
            "seeds": len(quality),
        }
        for key in QUALITY:
            values = [q[key] for q in quality]
            row[key] = statistics.fmean(values)
            if len(values) > 1:
                row[f"{key}_std"] = statistics.stdev(values)
        row["noisy"] = any(q["stalled_seconds"] > NOISY * q["train_seconds"] for q in quality)
        rows.append(row)
    return rows


COLUMNS = {  # key: (markdown header, format)
    "backbone": ("backbone", "{}"), "routing": ("routing", "{}"), "kind": ("kind", "{}"),
    "params": ("params", "{:,}"), "gflops_per_step": ("GFLOPs / step (1)", "{:.2f}"),
    "ideal_speedup": ("FLOP-ideal speedup", "{:.2f}x"), "measured_speedup": ("measured speedup (2)", "{:.2f}x"),
    "efficiency": ("efficiency", "{:.2f}"), "step_ms": ("step ms", "{:.0f}"),
    "saved_activation_mb": ("saved activations MB (3)", "{:.1f}"), "peak_memory_mb": ("peak memory MB", "{:.0f}"),
    "train_steps": ("steps in budget (4)", "{:.0f}"), "images_per_s": ("img/s", "{:.0f}"),
    "ema_loss": ("EMA loss (5)", "{:.4f}"), "classifier_fd": ("classifier-FD (6)", "{:.2f}"),
    "class_accuracy": ("class accuracy (6)", "{:.1%}"),
}


def _cell_text(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return "n/a"
    text = COLUMNS[key][1].format(value)
    std = row.get(f"{key}_std")
    text = text if std is None else f"{text} ± {COLUMNS[key][1].format(std)}"
    return f"{text} †" if key == "train_steps" and row["noisy"] else text


def markdown(rows: list[dict], meta: dict) -> str:
    m = meta
    lines = [f"| {' | '.join(h for h, _ in COLUMNS.values())} |", "|" + "---|" * len(COLUMNS)]
    lines += [f"| {' | '.join(_cell_text(r, k) for k in COLUMNS)} |" for r in rows]
    t, q, e, c = m["timing"], m["train"], m["eval"], m["classifier"]
    notes = [
        "",
        f"Command: `{m['command']}` ({m['date']}). Machine: {m['machine']['cpu']}, {m['machine']['cores']} cores, "
        f"torch {m['machine']['torch']}, device {m['machine']['device']}, {m['machine']['threads']} threads. "
        f"1-minute load average {m['load_average']}.",
        "",
        f"(1) Forward + backward FLOPs of one training step (batch {t['batch']}, {t['tokens']} tokens) as "
        "torch.utils.flop_counter sees them: matmuls, convolutions and attention. Not counted: the Bi-WKV and "
        "selective-scan recurrences (element-wise cumulative sums / multiply-adds), norms, activations, adaLN "
        "modulation, gather/scatter, the optimizer. FLOP-ideal speedup = FLOPs of the same backbone unrouted / FLOPs "
        "of the cell.",
        f"(2) Median of {t['repeats']} training steps after {t['warmup']} warm-up rounds, at {t['tokens']} tokens, timed "
        "round-robin over all cells so that machine noise hits every cell alike; speedup = unrouted step time / step "
        "time. Efficiency = measured / FLOP-ideal.",
        "(3) Bytes of the tensors autograd saves for backward in one forward (saved-tensor hooks, weights excluded). "
        "Peak memory is measured on CUDA only.",
        f"(4) Quality columns: the real Trainer for {q['budget']} per cell on {q['data']} ({q['tokens']} tokens), "
        f"batch {q['batch_size']}, seeds {q['seeds']}; ablation = routing.allow_unstructured=true (a random subset "
        f"without a grid on a scan-order backbone). † more than {NOISY:.0%} of the budget went to steps slower than "
        f"{STALL:g}x the cell's median step (another job on the machine): that cell trained fewer steps than it could "
        "have; delete its cells/<cell>.json and re-run the command to redo it.",
        f"(5) EDM loss of the EMA model (eval mode, unrouted) on a fixed batch of {e['loss_batch']} images "
        f"({e['reference']}) with fixed sigma and noise, identical for every cell.",
        f"(6) {e['samples']} class-conditional samples (Heun, {e['steps']} steps, guidance {e['guidance']}, seed "
        f"{e['seed']}) scored by a small CNN trained on {q['data']} (held-out accuracy {c['heldout_accuracy']:.1%}): "
        f"classifier-FD = Fréchet distance of its {c['config']['feature_dim']}-d penultimate features against {e['num_real']} real "
        "images (NOT Inception FID; comparable only within this table); class accuracy = share of samples classified "
        f"as the class they were asked for. For reference, {e['samples']} other real images score classifier-FD "
        f"{e['real_scores']['classifier_fd']:.2f} and class accuracy {e['real_scores']['class_accuracy']:.1%}.",
    ]
    return "\n".join(lines + notes) + "\n"


def write_tables(rows: list[dict], meta: dict, out: Path) -> str:
    text = markdown(rows, meta)
    (out / "table.md").write_text(text)
    write_json_atomic(out / "table.json", {"meta": meta, "rows": rows})
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with (out / "table.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows({k: "n/a" if r.get(k) is None else r[k] for k in keys} for r in rows)
    return text


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# The run.


def run(bench: DictConfig) -> list[dict]:
    began = time.perf_counter()
    if bench.threads:
        torch.set_num_threads(bench.threads)
    out = Path(bench.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grid, seeds = bench.grid, list(bench.seeds)
    if not grid.backbones or not grid.routings or not seeds:
        raise ConfigError("grid.backbones, grid.routings and seeds must each name at least one entry.")
    cells = [compose_cell(bench, b, r, s) for b in grid.backbones for r in grid.routings for s in seeds]
    pairs = [c for c in cells if c.seed == seeds[0]]
    cfg = pairs[0].cfg
    dataset = build_dataset(cfg.data, cfg.edm.sigma_data)
    timing_shape = (dataset.shape[0], bench.timing.resolution, bench.timing.resolution)

    # Cost: one unit, because the steps of all cells are timed together.
    cost_settings = {"cells": {c.key: OmegaConf.to_container(c.cfg.backbone) | {"routing": OmegaConf.to_container(c.cfg.routing)}
                               for c in pairs},
                     "shape": timing_shape, "num_classes": dataset.num_classes, "timing": OmegaConf.to_container(bench.timing),
                     "device": bench.device, "threads": bench.threads}
    cost = reuse_or_compute(out / "cost.json", cost_settings, lambda: measure_costs(pairs, bench, timing_shape, dataset.num_classes),
                            "cost measurements")
    params = {key: c["params"] for key, c in cost["cells"].items()}
    log.info("parameters: " + ", ".join(f"{key} {n / 1e6:.3f}M" for key, n in params.items()))
    if max(params.values()) > (1 + PARAM_SPREAD) * min(params.values()):
        log.warning(f"parameter counts differ by more than {PARAM_SPREAD:.0%}; adjust sizes.<backbone> for a matched comparison.")

    # Quality: one unit per training run.
    clf_cfg = ClassifierConfig(**{f.name: bench.classifier[f.name] for f in fields(ClassifierConfig)})
    classifier, clf_meta = load_or_train(dataset, clf_cfg, bench.classifier.cache_dir)
    log.info(f"classifier for {dataset.name} {tuple(dataset.shape)}: held-out accuracy {clf_meta['heldout_accuracy']:.1%}")
    evaluation = Evaluation(bench, cfg, dataset, classifier)
    eval_settings = {"eval": OmegaConf.to_container(bench.eval), "classifier": clf_meta, "device": bench.device, "threads": bench.threads}
    runs: dict[str, list[dict]] = {c.key: [] for c in pairs}
    warm = functools.cache(lambda: warm_up(pairs, dataset.shape, dataset.num_classes, bench))  # once, if any cell trains
    for cell in tqdm(cells, desc="quality: cells", dynamic_ncols=True):
        settings = {"train": OmegaConf.to_container(cell.cfg, resolve=True), **eval_settings}
        compute = lambda cell=cell: warm() or train_and_score(cell, evaluation, out)  # noqa: E731
        runs[cell.key].append(reuse_or_compute(out / "cells" / f"{cell.name}.json", settings, compute, f"cell {cell.name}"))

    # Table and plots.
    rows = table_rows(pairs, cost["cells"], runs)
    t = bench.train
    budget = f"{t.minutes:g} min" if t.minutes else f"{t.max_steps} steps"
    loads = [cost["load_average"][0]] + [q["load_average"][0] for qs in runs.values() for q in qs]
    meta = {
        "command": " ".join(["python -m train.bench", *sys.argv[1:]]), "date": now(),
        "machine": {"cpu": cpu_model() if bench.device == "cpu" else torch.cuda.get_device_name(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "device": bench.device, "threads": torch.get_num_threads()},
        "load_average": f"{min(loads):.1f} to {max(loads):.1f} (sampled after the cost phase and after each cell)",
        "timing": {**OmegaConf.to_container(bench.timing), "tokens": next(iter(cost["cells"].values()))["tokens"]},
        "train": {"budget": budget, "data": f"{dataset.name} {'x'.join(map(str, dataset.shape))}", "batch_size": t.batch_size,
                  "tokens": dataset.shape[1] * dataset.shape[2] // cfg.backbone.patch_size**2,
                  "seeds": seeds},
        "eval": {"loss_batch": len(evaluation.y), "reference": evaluation.reference, "samples": len(evaluation.sample_labels),
                 "num_real": len(evaluation.real_features), "real_scores": evaluation.real_scores,
                 **{k: bench.eval[k] for k in ("steps", "guidance", "seed")}},
        "classifier": clf_meta,
        "seconds_this_invocation": time.perf_counter() - began,
    }
    text = write_tables(rows, meta, out)
    plot_loss_curves({(c.backbone, c.routing): [q["curve"] for q in runs[c.key]] for c in pairs}, out / "loss_vs_time.png", budget)
    plot_bars(rows, out / "bars.png", {"efficiency": "efficiency (measured / FLOP-ideal)", "ema_loss": "EMA loss (lower is better)",
                                       "classifier_fd": "classifier-FD (lower is better)", "class_accuracy": "class accuracy"})
    print(text)
    log.info(f"wrote {out}/table.md, table.csv, table.json, loss_vs_time.png, bars.png in {time.perf_counter() - began:.0f} s")
    return rows


@hydra.main(config_path="../configs", config_name="bench", version_base="1.3")
@friendly_errors
def main(bench: DictConfig) -> None:
    run(bench)


if __name__ == "__main__":
    main()
