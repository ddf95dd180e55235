"""PNG plots of the cross-backbone benchmark (train/bench/): loss against wall-clock time, and bar charts."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

LINESTYLES = {"none": "-", "random": "--", "rows": ":"}


def ema_smooth(values: list[float], beta: float = 0.95) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard's smoothing, without its warm start)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def _colours(backbones: list[str]) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {b: cycle[i % len(cycle)] for i, b in enumerate(backbones)}


def plot_loss_curves(curves: dict[tuple[str, str], list[dict]], path: Path, budget_label: str) -> None:
    """One line per (backbone, routing) and seed: EMA-smoothed training loss against seconds of training."""
    backbones = list(dict.fromkeys(b for b, _ in curves))
    colours = _colours(backbones)
    fig, ax = plt.subplots(figsize=(8, 5))
    for (backbone, routing), runs in curves.items():
        for i, run in enumerate(runs):
            if not run["seconds"]:
                continue
            ax.plot(run["seconds"], ema_smooth(run["loss"]), color=colours[backbone], linestyle=LINESTYLES.get(routing, "-."),
                    label=f"{backbone} / {routing}" if i == 0 else None, linewidth=1.4)
    ax.set_xlabel("wall-clock seconds of training")
    ax.set_ylabel("training loss (EMA-smoothed)")
    ax.set_yscale("log")
    ax.set_title(f"Training loss at an equal wall-clock budget ({budget_label})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(rows: list[dict], path: Path, panels: dict[str, str]) -> None:
    """Grouped bars (groups: backbones, bars: routings), one panel per column in `panels` (key -> title).

    Ablation cells (an unstructured subset on a scan-order backbone) are hatched; missing values are skipped.
    """
    backbones = list(dict.fromkeys(r["backbone"] for r in rows))
    routings = list(dict.fromkeys(r["routing"] for r in rows))
    width = 0.8 / len(routings)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.3))
    axes = list(getattr(axes, "flat", [axes]))
    for ax, (key, title) in zip(axes, panels.items()):
        for j, routing in enumerate(routings):
            labelled = False
            for i, backbone in enumerate(backbones):
                row = next((r for r in rows if r["backbone"] == backbone and r["routing"] == routing), None)
                if row is None or not isinstance(row.get(key), (int, float)):
                    continue
                ax.bar(i + (j - (len(routings) - 1) / 2) * width, row[key], width, color=f"C{j}",
                       hatch="//" if row["kind"] == "ablation" else None, edgecolor="black", linewidth=0.5,
                       label=None if labelled else routing)
                labelled = True
        ax.set_xticks(range(len(backbones)), backbones)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    legend = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    legend["1-D ablation (random subset on a scan-order backbone)"] = Patch(facecolor="white", edgecolor="black", hatch="//")
    fig.legend(legend.values(), legend.keys(), loc="upper center", ncol=len(legend), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_quality_curves(curves: dict[tuple[str, str], list[dict]], path: Path) -> None:
    """Held-out EMA loss of the checkpoints against optimizer steps (left) and training seconds (right).

    One line per (backbone, routing): the mean over seeds at the steps every seed reached, with the seeds'
    min-max band, so a routed line below its baseline at the same step means routing cost nothing per update.
    """
    backbones = list(dict.fromkeys(b for b, _ in curves))
    colours = _colours(backbones)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for (backbone, routing), runs in curves.items():
        runs = [r for r in runs if r and r["step"]]
        if not runs:
            continue
        steps = sorted(set.intersection(*(set(r["step"]) for r in runs)))
        if not steps:
            continue
        losses = [[r["ema_loss"][r["step"].index(s)] for r in runs] for s in steps]  # (steps, seeds)
        seconds = [sum(r["seconds"][r["step"].index(s)] or 0 for r in runs) / len(runs) for s in steps]
        mean = [sum(v) / len(v) for v in losses]
        style = dict(color=colours[backbone], linestyle=LINESTYLES.get(routing, "-."), linewidth=1.5, marker=".")
        for ax, x in zip(axes, (steps, seconds)):
            ax.plot(x, mean, label=f"{backbone} / {routing}", **style)
            ax.fill_between(x, [min(v) for v in losses], [max(v) for v in losses], color=colours[backbone], alpha=0.12)
    for ax, xlabel in zip(axes, ("optimizer steps", "wall-clock seconds of training (this machine, shared)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out EMA loss (lower is better)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title("Quality against optimizer steps (mean over seeds, band: min-max)")
    axes[1].set_title("The same checkpoints against training time")
    axes[0].legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
