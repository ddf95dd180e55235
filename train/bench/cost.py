"""Cost of one training step of every cell: parameters, FLOPs, activation memory and interleaved step times."""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from backbones.diffmoe import activated_parameters
from train.bench.cells import Cell
from routing import count_flops
from train.bench.timing import interleaved_medians, now, peak_memory_bytes, saved_activation_bytes, step_clock, training_step
from train.build import build_backbone_for, objective_for


def measure_costs(pairs: list[Cell], bench: DictConfig, shape: tuple[int, ...], num_classes: int) -> dict:
    """Cost of one training step of every pair at the timing shape; step times interleaved over all pairs."""
    device, t = torch.device(bench.device), bench.timing
    steps, costs = {}, {}
    for cell in tqdm(pairs, desc="cost: FLOPs and memory", dynamic_ncols=True):
        torch.manual_seed(cell.seed)  # the same initial weights for every routing of a backbone
        model = build_backbone_for(cell.cfg, shape, num_classes)
        objective = objective_for(cell.cfg)
        net = objective.wrap(model).to(device).train()
        step = training_step(net, t.batch, shape, num_classes, device, seed=cell.seed, objective=objective)
        costs[cell.key] = {
            "params": sum(p.numel() for p in net.parameters()),
            # Per token in training: all weights but the experts a token does not get (MoE: top_k or C of E).
            "activated_params": activated_parameters(net),
            "tokens": model.grid[0] * model.grid[1],
            "flops": count_flops(step, grad=True),
            "saved_activation_bytes": saved_activation_bytes(step.loss, net.parameters()),
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
    """FLOP-ideal and measured speedup of a cell over its backbone's unrouted cell, and their ratio."""
    if base is None:
        return {"ideal_speedup": None, "measured_speedup": None, "efficiency": None}
    ideal = base["flops"] / cost["flops"]
    measured = base["step_seconds"] / cost["step_seconds"]
    return {"ideal_speedup": ideal, "measured_speedup": measured, "efficiency": measured / ideal}
