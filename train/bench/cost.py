"""Cost of one training step of every cell: parameters, FLOPs, activation memory and interleaved step times."""

from __future__ import annotations

import logging
import os

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from backbones.diffmoe import activated_parameters
from train.bench.cells import Cell, compose_cell, compose_pair
from train.bench.store import reuse_or_compute, saved_result, saved_subset
from routing import count_flops
from train.bench.timing import interleaved_medians, now, peak_memory_bytes, saved_activation_bytes, step_clock, training_step
from train.build import build_backbone_for, build_ema, objective_for
from train.metrics.alignment import build_alignment

log = logging.getLogger(__name__)


def measure_costs(pairs: list[Cell], bench: DictConfig, shape: tuple[int, ...], num_classes: int) -> dict:
    """Cost of one training step of every pair at the timing shape; step times interleaved over all pairs."""
    device, t = torch.device(bench.device), bench.timing
    steps, costs = {}, {}
    for cell in tqdm(pairs, desc="cost: FLOPs and memory", dynamic_ncols=True):
        torch.manual_seed(cell.seed)  # the same initial weights for every routing of a backbone
        model = build_backbone_for(cell.cfg, shape, num_classes)
        objective = objective_for(cell.cfg)
        net = objective.wrap(model).to(device).train()
        # Alignment (align=repa|self): its loss, the EMA teacher's forward up to its block (no grad) and the projector's
        # forward and backward are part of the step, so the FLOPs, step times and equal-compute budgets include them.
        align = build_alignment(cell.cfg, model, device)
        ema = build_ema(cell.cfg, net, device).module if align is not None and align.mode == "self" and align.teacher == "ema" else None
        step = training_step(net, t.batch, shape, num_classes, device, seed=cell.seed, objective=objective, align=align, ema=ema)
        costs[cell.key] = {
            # The model's own weights: the projector trains beside it but is dropped from the sampled model.
            "params": sum(p.numel() for p in net.parameters()),
            **({"align_params": sum(p.numel() for p in align.parameters())} if align is not None else {}),
            # Per token in training: all weights but the experts a token does not get (MoE: top_k or C of E).
            "activated_params": activated_parameters(net),
            "tokens": model.grid[0] * model.grid[1],
            "flops": count_flops(step, grad=True),
            "saved_activation_bytes": saved_activation_bytes(step.loss, [*net.parameters(), *(align.parameters() if align else [])]),
            "peak_memory_bytes": peak_memory_bytes(step, device),
        }
        steps[cell.key] = step
    clock, clock_name = step_clock(device, bench.threads)
    with tqdm(total=len(steps) * (t.warmup + t.repeats), desc="cost: interleaved step timing", dynamic_ncols=True) as bar:
        seconds = interleaved_medians(steps, t.repeats, t.warmup, device, progress=bar.update, clock=clock)
    for key, s in seconds.items():
        costs[key]["step_seconds"] = s
    return {"cells": costs, "clock": clock_name, "date": now(), "load_average": os.getloadavg()}


def speedups(base: dict | None, cost: dict) -> dict[str, float | None]:
    """FLOP-ideal and measured speedup of a cell over its backbone's unrouted cell, and their ratio.

    An aligned cell carries its own `base`: the unrouted, unaligned cell timed in the same rounds (the aligned cells'
    cost unit, runner.aligned_costs), since step times of different units are not comparable."""
    base = cost.get("base", base)
    if base is None:
        return {"ideal_speedup": None, "measured_speedup": None, "efficiency": None}
    ideal = base["flops"] / cost["flops"]
    measured = base["step_seconds"] / cost["step_seconds"]
    return {"ideal_speedup": ideal, "measured_speedup": measured, "efficiency": measured / ideal}


def unit_settings(cells: list[Cell], bench: DictConfig, shape, num_classes: int, aligned: bool) -> tuple[dict, dict]:
    """A cost unit's settings (what its measurements hold for) and the plain configs' defaults (store.same_settings).
    The unaligned unit records what it did before alignment existed, so the committed cost.json files are reused."""
    def cell(c: Cell, conf: dict) -> dict:
        return conf["backbone"] | {"routing": conf["routing"]} | ({"align": conf.get("align") or {"name": "none"}} if aligned else {})

    settings = {"cells": {c.key: cell(c, OmegaConf.to_container(c.cfg)) for c in cells},
                "shape": shape, "num_classes": num_classes, "timing": OmegaConf.to_container(bench.timing),
                "device": bench.device, "threads": bench.threads, "clock": step_clock(bench.device, bench.threads)[1]}
    return settings, {"cells": {c.key: cell(c, c.plain) for c in cells}}


def aligned_unit(cells: list[Cell], bench: DictConfig) -> list[Cell]:
    """The aligned cells of one alignment and, timed in the same rounds, each family's unrouted unaligned cell: the
    base of their speedups and step budgets (composed here when the grid leaves it out, e.g. grid.aligns=[self])."""
    bases = []
    for backbone in dict.fromkeys(c.backbone for c in cells):
        bases.append(compose_cell(bench, backbone, "none", cells[0].seed, compose_pair(bench, backbone, "none")))
    return bases + cells


def cost_phase(bench: DictConfig, pairs: list[Cell], results, shape, num_classes: int, measure_aligned: bool = True) -> dict:
    """Every pair's cost: the unaligned pairs from `results`/cost.json (reused when it measured them, a bigger grid
    included), each alignment's from cost-<align>.json with its own unaligned bases. Aligned cells carry their `base`.
    measure_aligned=False (measured_only): an alignment whose costs are not saved yet is left out, not measured."""
    merged, loads, clock = {}, [], None
    for align in dict.fromkeys(c.align for c in pairs):
        mine = [c for c in pairs if c.align == align]
        unit = mine if align == "none" else aligned_unit(mine, bench)
        path = results / ("cost.json" if align == "none" else f"cost-{align}.json")
        settings, defaults = unit_settings(unit, bench, shape, num_classes, aligned=align != "none")
        cost = saved_subset(path, settings, "cells", defaults) if align == "none" else None
        if cost is not None:
            log.info(f"reused cost measurements from {path} ({len(unit)} of its {len(cost['settings']['cells'])} cells)")
        elif align != "none" and not measure_aligned and saved_result(path, settings, defaults) is None:
            log.info(f"no cost measurements of the align={align} cells in {path} yet; they stay out of this table")
            continue
        else:
            cost = reuse_or_compute(path, settings, lambda unit=unit: measure_costs(unit, bench, shape, num_classes),
                                    "cost measurements", defaults)
        for c in mine:
            merged[c.key] = cost["cells"][c.key] | ({} if align == "none" else {"base": cost["cells"][f"{c.backbone}-none"]})
        loads.append(cost["load_average"][0])
        clock = clock or cost.get("clock")
    loads = loads or [float("nan")]
    return {"cells": merged, "load_average": [min(loads), max(loads)], "clock": clock or "wall-clock time"}
