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
