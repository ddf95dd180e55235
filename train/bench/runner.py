"""The cross-backbone table, end to end: cells, cost, quality, then the report (`python -m train.bench`).

    python -m train.bench                   # default mode: the digits table (docs/reports/2026-11-22-bench-digits.md)
    python -m train.bench bench=fashion     # Fashion-MNIST at 256 tokens, 3 seeds, held-out scores, equal compute
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
by train/metrics/classifier.py (classifier-FD and class accuracy; not Inception FID). A dataset with a test split
(Fashion-MNIST) is scored against the test split, with the train-vs-test floor beside it. `train.steps` turns the
wall-clock budget into equal compute as steps (routed cells: x their measured speedup); `eval.every` and
`eval.at_steps` add quality against optimizer steps from the checkpoints the trainer writes on the way.

Outputs in bench_runs/<name>/: table.md, table.csv, table.json, loss_vs_time.png, bars.png,
samples/<cell>.png and runs/<cell>/ (the trainer's metrics.jsonl). cost.json and each cell JSON are written
atomically with the settings they were measured under; a re-run with the same settings reuses them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from routing import ConfigError
from train.bench.claims import claim, waiting_claim
from train.bench.cells import grid_cells, pair_cells, recipe_label, set_step_budget
from train.bench.cost import cost_phase, speedups
from train.bench.plots import plot_bars, plot_loss_curves, plot_quality_curves
from train.bench.quality import Evaluation, held_out_split, train_and_score, warm_up
from train.bench.report import table_rows, write_tables
from train.bench.store import check_saved, cost_cells, reuse_or_compute, saved_result
from train.bench.timing import now
from train.build import objective_name
from train.data import build_dataset
from train.metrics.classifier import ClassifierConfig, cache_path, load_or_train
from train.rundir import HydraRecord

log = logging.getLogger(__name__)

PARAM_SPREAD = 0.15  # matched size: the largest parameter count may exceed the smallest by this fraction


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def parse_shard(text) -> tuple[int, int] | None:
    """`shard=i/n`: this process trains cells i, i + n, i + 2n, ... of the grid (several processes share one out_dir)."""
    if text is None:
        return None
    try:
        i, n = (int(v) for v in str(text).split("/"))
    except ValueError:
        i = n = -1
    if not 0 <= i < n:
        raise ConfigError(f"shard={text!r} must be i/n with 0 <= i < n (e.g. shard=0/2 and shard=1/2 in two processes).")
    return i, n


def speedups_source(bench: DictConfig) -> Path | None:
    """The cost.json that `train.speedups_from` names (None: this bench's own), refused if it does not exist."""
    source = bench.train.get("speedups_from")
    if not source:
        return None
    path = Path(str(source)).expanduser()
    if not path.is_file():
        raise ConfigError(f"train.speedups_from={source!r} does not exist; point it at another bench's cost.json "
                          "(e.g. docs/bench/fashion/cost.json).")
    return path


def check_before_writing(bench: DictConfig, pairs: list) -> None:
    """What the grid's training configs do not check and would otherwise refuse minutes into the cost phase, of the
    checks that need the composed pairs (the cheaper ones come before the composition)."""
    resolution = bench.timing.resolution
    for cell in pairs:
        patch = cell.cfg.backbone.patch_size
        if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1 or resolution % patch:
            raise ConfigError(f"timing.resolution={resolution!r} must be a positive multiple of backbone.patch_size={patch} "
                              f"({cell.key}); e.g. timing.resolution={patch * 16}.")


def refuse_missing_costs(bench: DictConfig, pairs: list) -> None:
    """Before any work, every cost the step budgets read must exist: each pair's, and under a step budget each routed
    pair's unrouted cell, whose step time sets its equal-compute budget (without it the routed cell would silently
    train the unrouted step count). They come from this bench's own grid, or from `train.speedups_from`."""
    keys = {c.key for c in pairs}
    # An aligned cell's base is measured with it (cost.aligned_unit), so only the unaligned routed cells need theirs here.
    baselines = {f"{c.backbone}-none" for c in pairs if c.routing != "none" and c.align == "none"} if bench.train.get("steps") is not None else set()
    source = speedups_source(bench)
    if source is not None:
        try:
            theirs = set(cost_cells(source))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"train.speedups_from={str(source)!r} is not a bench's cost.json; point it at one "
                              "(e.g. docs/bench/fashion/cost.json).") from None
        missing = sorted((keys | baselines) - theirs)
        if missing:
            raise ConfigError(f"train.speedups_from={str(source)!r} has no cost of {missing}; give a cost.json measured for those pairs.")
        return
    lacking = sorted(baselines - keys)
    if lacking:
        raise ConfigError(f"{lacking[0]} is not in the grid (grid.routings, grid.skip), but its backbone's routed cells take "
                          "their equal-compute step budget from its step time; add none to grid.routings (measured cells "
                          "are reused).")


def budget_cost_cells(bench: DictConfig, own: dict) -> dict:
    """The cost cells whose measured speedups set the step budgets: this bench's own, or with
    `train.speedups_from` another bench's cost.json, so that two benches that differ only in what the step does
    not cost (the objective, say) train exactly the same step counts (refuse_missing_costs checked it holds them)."""
    path = speedups_source(bench)
    return own if path is None else cost_cells(path)


def refuse_another_scorer(cells_dir: Path, clf_meta: dict, weights: Path) -> None:
    """Refuse a classifier that was trained with the settings the saved cells record but came out different.

    Training the scorer is not bit-reproducible across CPU kernels (the Fashion-MNIST one scores 87.24% held out with
    AVX2 kernels and 87.20% with AVX-512; `python -m train.bench` pins AVX2), and a different scorer makes every saved
    cell's settings differ, so the bench would silently re-train and overwrite them all.
    Changed classifier settings (epochs, lr, ...) still re-measure the cells, as any changed setting does.
    """
    same_recipe = {k: v for k, v in clf_meta.items() if k != "heldout_accuracy"}
    for path in sorted(cells_dir.glob("*.json")):
        try:
            scorer = json.loads(path.read_text()).get("settings", {}).get("classifier") or {}
        except ValueError:
            continue  # a damaged cell is re-measured like any other mismatch
        if not isinstance(scorer, dict):
            continue  # not a scorer's record: the cell's settings differ, so it is re-measured
        retrained = scorer.get("heldout_accuracy", clf_meta["heldout_accuracy"]) != clf_meta["heldout_accuracy"]
        if retrained and {k: scorer.get(k) for k in same_recipe} == same_recipe:
            raise ConfigError(
                f"{path} was scored by a classifier with these settings and held-out accuracy {scorer['heldout_accuracy']:.2%}, "
                f"but {weights} scores {clf_meta['heldout_accuracy']:.2%} (trained with other CPU kernels?); delete it and run "
                f"`python -m train.bench` again, which retrains it with AVX2 kernels, or move {cells_dir} aside to re-measure every cell.")


def run(bench: DictConfig, record: HydraRecord | None = None) -> list[dict]:
    """The table of `bench`; `record` (Hydra's, from the command line) is written to out_dir once the checks passed."""
    began = time.perf_counter()
    if bench.threads:
        torch.set_num_threads(bench.threads)
    out = Path(bench.out_dir)
    results = Path(bench.get("results_dir") or out)  # cost.json and cells/*.json: the small files a table is rebuilt from
    # Keys that only steer this invocation are checked before the cost phase, not minutes into it.
    shard = parse_shard(bench.get("shard"))
    measured_only = bench.get("measured_only", False)
    if not isinstance(measured_only, bool):
        raise ConfigError(f"measured_only={measured_only!r} must be true or false (true: the table from the cells measured so far).")
    grid, seeds = bench.grid, list(bench.seeds)
    if not grid.backbones or not grid.routings or not seeds:
        raise ConfigError("grid.backbones, grid.routings and seeds must each name at least one entry.")
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad:  # before the grid's configs are composed (a second of CPU per pair)
        raise ConfigError(f"seeds={seeds} holds {bad[0]!r}; seeds are non-negative integers (e.g. seeds=[0,1,2]).")
    speedups_source(bench)
    cells = grid_cells(bench)
    pairs = pair_cells(cells)
    if not cells:
        raise ConfigError("grid.skip removes every pair of the grid; keep at least one backbone-routing pair.")
    refuse_missing_costs(bench, pairs)
    check_saved(results)  # a saved result of the wrong shape: refused now, not minutes in
    if measured_only and not any((results / "cells" / f"{c.name}.json").is_file() for c in cells):
        # Before the cost phase and the classifier: minutes of work for a table of nothing.
        raise ConfigError(f"measured_only=true but {(results / 'cells').resolve()} holds no cell of this grid (results_dir is "
                          "read from the current folder); run from the repository root, pass results_dir=<folder of cost.json and "
                          "cells/>, or run without measured_only to train them.")
    cfg = pairs[0].cfg
    dataset = build_dataset(cfg.data, cfg.edm.sigma_data)
    timing_shape = (dataset.shape[0], bench.timing.resolution, bench.timing.resolution)
    check_before_writing(bench, pairs)
    out.mkdir(parents=True, exist_ok=True)  # the first write: nothing before it can refuse
    if record is not None:
        record.write(out, key="out_dir")

    # Cost: one unit per alignment, because the steps of a unit's cells are timed together (train/bench/cost.py).
    cost = cost_phase(bench, pairs, results, timing_shape, dataset.num_classes, measure_aligned=not measured_only)
    unpriced = [c.key for c in pairs if c.key not in cost["cells"]]  # measured_only: aligned cells with no cost measured yet
    if unpriced:
        pairs, cells = [c for c in pairs if c.key in cost["cells"]], [c for c in cells if c.key in cost["cells"]]
    # Matched size means matched ACTIVATED parameters: an MoE model holds E experts but a token uses C of them.
    params = {key: c.get("activated_params", c["params"]) for key, c in cost["cells"].items()}
    log.info("activated parameters per token: " + ", ".join(f"{key} {n / 1e6:.3f}M" for key, n in params.items()))
    if max(params.values()) > (1 + PARAM_SPREAD) * min(params.values()):
        log.warning(f"activated parameter counts differ by more than {PARAM_SPREAD:.0%}; adjust sizes.<backbone> for a matched comparison.")

    # Step budgets (train.steps): equal compute from the measured speedups, when not a wall-clock budget.
    steps = bench.train.get("steps")
    budget_costs = budget_cost_cells(bench, cost["cells"])
    for cell in cells:
        budget = steps.get(cell.backbone) if steps is not None else None
        set_step_budget(cell, budget, speedups(budget_costs.get(f"{cell.backbone}-none"), budget_costs[cell.key])["measured_speedup"])

    # Quality: one unit per training run.
    clf_cfg = ClassifierConfig(**{f.name: bench.classifier[f.name] for f in fields(ClassifierConfig)})
    test = held_out_split(cfg, cfg.edm.sigma_data)  # Fashion-MNIST's test split; None for digits and shapes
    scorer = cache_path(bench.classifier.cache_dir, dataset)
    with waiting_claim(scorer.with_name(f"{scorer.name}.claim"), log=log.info):  # trained by one process at a time
        classifier, clf_meta = load_or_train(dataset, clf_cfg, bench.classifier.cache_dir, test)
    refuse_another_scorer(results / "cells", clf_meta, scorer)
    log.info(f"classifier for {dataset.name} {tuple(dataset.shape)}: held-out accuracy {clf_meta['heldout_accuracy']:.1%} "
             f"({clf_meta['accuracy_on']})")
    evaluation = Evaluation(bench, cfg, dataset, classifier, test)
    log.info(f"floor ({evaluation.floor}): classifier-FD {evaluation.real_scores['classifier_fd']:.2f}, "
             f"class accuracy {evaluation.real_scores['class_accuracy']:.1%}")
    eval_settings = {"eval": OmegaConf.to_container(bench.eval), "classifier": clf_meta, "device": bench.device, "threads": bench.threads}
    runs: dict[str, list[dict]] = {c.key: [] for c in pairs}
    warm = functools.cache(lambda: warm_up(pairs, dataset.shape, dataset.num_classes, bench))  # once, if any cell trains
    mine = [c for i, c in enumerate(cells) if shard is None or i % shard[1] == shard[0]]
    missing, elsewhere = [f"{key} (every seed; no cost measured yet)" for key in unpriced], []
    for cell in tqdm(mine, desc="quality: cells", dynamic_ncols=True):
        settings = {"train": OmegaConf.to_container(cell.cfg, resolve=True), **eval_settings}
        path, defaults = results / "cells" / f"{cell.name}.json", {"train": cell.plain}
        saved = saved_result(path, settings, defaults)
        if saved is not None:
            log.info(f"reused cell {cell.name} from {path}")
        if saved is not None or measured_only:
            runs[cell.key] += [saved] if saved else []
            missing += [] if saved else [cell.name]
            continue
        with claim(out / "claims" / f"{cell.name}.pid") as holder:  # other processes of this command skip it meanwhile
            if holder is not None:
                elsewhere.append(f"{cell.name} (process {holder})")
                continue
            compute = lambda cell=cell: warm() or train_and_score(cell, evaluation, out)  # noqa: E731
            runs[cell.key].append(reuse_or_compute(path, settings, compute, f"cell {cell.name}", defaults))
    if elsewhere:
        log.info(f"{len(elsewhere)} cells are being trained by other processes: {', '.join(elsewhere)}; run the command again "
                 "once they finish to write the table (it reuses every cell).")
        return []
    if missing:
        log.warning(f"measured_only: {len(missing)} cells are not measured yet and stay out of the table: {', '.join(missing)}")
        pairs = [c for c in pairs if runs[c.key]]
        if not pairs:
            raise ConfigError("measured_only=true but no cell of this grid is measured yet; run without it to train them.")
    if shard is not None:
        log.info(f"shard {shard[0]}/{shard[1]}: its {len(mine)} cells are done; once every shard is, run the command without "
                 "shard= to write the table (it reuses every cell).")
        return []

    # Table and plots.
    rows = table_rows(pairs, cost["cells"], runs, OmegaConf.to_container(grid.get("baselines") or OmegaConf.create({})))
    t = bench.train
    wall_clock = t.get("steps") is None and bool(t.minutes)  # a stall then costs the cell steps, not only time
    if t.get("steps") is not None:
        budget = "equal compute: " + ", ".join(f"{b} {n} steps unrouted" for b, n in t.steps.items() if b in grid.backbones) + \
                 " (routed cells: x their measured speedup" + \
                 (f" in {t.speedups_from})" if t.get("speedups_from") else ")")
    else:
        budget = f"{t.minutes:g} min" if t.minutes else f"{t.max_steps} steps"
    loads = list(cost["load_average"]) + [q["load_average"][0] for qs in runs.values() for q in qs]
    meta = {
        "command": " ".join(["python -m train.bench", *sys.argv[1:]]), "date": now(),
        "machine": {"cpu": cpu_model() if bench.device == "cpu" else torch.cuda.get_device_name(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "device": bench.device, "threads": torch.get_num_threads()},
        "load_average": f"{min(loads):.1f} to {max(loads):.1f} (sampled after the cost phase and after each cell)",
        "timing": {**OmegaConf.to_container(bench.timing), "tokens": next(iter(cost["cells"].values()))["tokens"],
                   "clock": cost.get("clock", "wall-clock time")},
        "train": {"budget": budget, "wall_clock": wall_clock, "data": f"{dataset.name} {'x'.join(map(str, dataset.shape))}",
                  "batch_size": t.batch_size,
                  "tokens": dataset.shape[1] * dataset.shape[2] // cfg.backbone.patch_size**2, "objective": objective_name(cfg),
                  "seeds": seeds, "missing": missing},
        "eval": {"loss_batch": len(evaluation.y), "reference": evaluation.reference, "samples": len(evaluation.sample_labels),
                 "num_real": len(evaluation.real_features), "real_scores": evaluation.real_scores, "floor": evaluation.floor,
                 "every": bench.eval.get("every") or 0, "at_steps": dict(bench.eval.get("at_steps") or {}),
                 **{k: bench.eval[k] for k in ("steps", "guidance", "seed")}},
        "classifier": clf_meta,
        "seconds_this_invocation": time.perf_counter() - began,
    }
    text = write_tables(rows, meta, out)
    plot_loss_curves({(c.backbone, c.recipe): [q["curve"] for q in runs[c.key]] for c in pairs}, out / "loss_vs_time.png", budget)
    if any(q.get("quality_curve", {}).get("step") for qs in runs.values() for q in qs):
        plot_quality_curves({(c.backbone, c.recipe): [q.get("quality_curve") for q in runs[c.key]] for c in pairs},
                            out / "quality_vs_steps.png")
    plot_bars([r | {"routing": recipe_label(r["routing"], r.get("align_label") or r.get("align", "none"))} for r in rows], out / "bars.png", {"efficiency": "efficiency (measured / FLOP-ideal)", "ema_loss": "EMA loss (lower is better)",
                                       "classifier_fd": "classifier-FD (lower is better)", "class_accuracy": "class accuracy",
                                       **({"at_step_classifier_fd": "classifier-FD at the matched step"}
                                          if any("at_step_classifier_fd" in r for r in rows) else {})})
    print(text)
    log.info(f"wrote {out}/table.md, table.csv, table.json, loss_vs_time.png, bars.png in {time.perf_counter() - began:.0f} s")
    return rows
