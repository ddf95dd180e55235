"""The front page's figure: samples of the benchmark's best cells beside the recipes' classifier-FD bars.

    python -m train.bench.figure                  # docs/figures/front.png from the committed Fashion-MNIST cells (seconds)
    python -m train.bench.figure --results docs/bench/fashion --out front.png

Reads only what the Fashion-MNIST bench commits (docs/benchmark_results.md): the cell files (classifier-FD at equal compute,
one file per seed) and the scored sample grids it wrote per cell (samples/<cell>.png, one row per class). Left: for
each family, the grid of its best recipe (lowest mean classifier-FD), seed 0. Right: every family's recipes, the mean
over seeds with its 95% t-interval. No checkpoint is needed, so a fresh clone redraws it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402

from routing import ConfigError  # noqa: E402
from train.bench.stats import summary  # noqa: E402
from train.cli import friendly_errors  # noqa: E402

FAMILIES = {"dit": "DiT", "rwkv": "Diffusion-RWKV", "mamba": "Mamba", "diffmoe": "DiffMoE"}
# The recipe bars, TREAD under each family's usual selection: random for attention, whole rows for scan-order models.
RECIPES = {"none": "unrouted", "tread": "TREAD (random; rows on RWKV, Mamba)", "structured": "TREAD, structured",
           "sprint": "SPRINT"}
USUAL = {"dit": "random", "rwkv": "rows", "mamba": "rows", "diffmoe": "random"}
COLUMNS = 10  # sample columns kept per class row, so four families' grids fit beside the bars


def recipe_routing(family: str, recipe: str) -> str:
    return USUAL[family] if recipe == "tread" else recipe


def load_cell(path: Path) -> dict:
    """One cell file, or one sentence naming the damaged file (the figures read, never write, the cells)."""
    try:
        cell = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a readable cell file ({type(e).__name__}); restore it from git "
                          "(git checkout -- <file>) or run `python -m train.bench` again to re-measure it.") from None
    if not isinstance(cell, dict) or not {"cell", "backbone", "routing", "seed"} <= cell.keys():
        raise ConfigError(f"{path} is not a bench cell file (no cell, backbone, routing, seed keys); move it out of "
                          f"{path.parent}, which holds only `python -m train.bench`'s cell files.")
    return cell


def read_cells(cells: Path) -> dict[tuple[str, str], list[dict]]:
    """The unaligned cells of the four families, by (family, routing): one dict per seed."""
    found: dict[tuple[str, str], list[dict]] = {}
    for path in sorted(cells.glob("*.json")):
        cell = load_cell(path)
        if cell["backbone"] in FAMILIES and cell["cell"] == f"{cell['backbone']}-{cell['routing']}-s{cell['seed']}":
            found.setdefault((cell["backbone"], cell["routing"]), []).append(cell)
    return found


def fd_summaries(cells: dict[tuple[str, str], list[dict]]) -> dict[tuple[str, str], dict]:
    """classifier-FD at equal compute, mean and 95% t-interval over seeds, per (family, recipe) that was measured."""
    return {(family, recipe): summary([c["classifier_fd"] for c in cells[(family, recipe_routing(family, recipe))]])
            for family in FAMILIES for recipe in RECIPES if (family, recipe_routing(family, recipe)) in cells}


def best_cells(cells: dict[tuple[str, str], list[dict]], fds: dict[tuple[str, str], dict]) -> dict[str, dict]:
    """Per family: the routed recipe with the lowest mean classifier-FD, and its lowest-seed cell."""
    best = {}
    for family in FAMILIES:
        routed = [(fds[(family, r)]["mean"], r) for r in RECIPES if r != "none" and (family, r) in fds]
        if routed:
            _, recipe = min(routed)
            best[family] = min(cells[(family, recipe_routing(family, recipe))], key=lambda c: c["seed"]) | {"recipe": recipe}
    return best


def sample_tile(path: Path) -> Image.Image:
    """The left COLUMNS samples of every class row of a scored grid (torchvision's grid: square tiles, 2 px padding)."""
    grid = Image.open(path).convert("RGB")
    tile = (grid.height - 2) // 10  # ten class rows
    return grid.crop((0, 0, 2 + COLUMNS * tile, grid.height))


def draw(results: Path, out: Path) -> None:
    cells = read_cells(results / "cells")
    if not cells:
        raise ConfigError(f"no cell files of {', '.join(FAMILIES)} in {results / 'cells'}; point --results at a "
                          "bench's results_dir (docs/bench/fashion holds the committed ones).")
    fds = fd_summaries(cells)
    best = best_cells(cells, fds)
    missing = [f"{results / 'samples' / c['cell']}.png" for c in best.values() if not (results / "samples" / f"{c['cell']}.png").is_file()]
    if missing:
        raise ConfigError(f"no sample grid {', '.join(missing)}; copy it from the bench's out_dir "
                          "(bench_runs/<name>/samples/) beside the cells.")

    fig = plt.figure(figsize=(14, 6.2))
    grid = fig.add_gridspec(2, 4, width_ratios=(1, 1, 0.3, 2.3), wspace=0.05, hspace=0.25)
    for i, (family, cell) in enumerate(best.items()):
        ax = fig.add_subplot(grid[i // 2, i % 2])
        ax.imshow(sample_tile(results / "samples" / f"{cell['cell']}.png"))
        recipe = f"TREAD, {cell['routing']}" if cell["recipe"] == "tread" else RECIPES[cell["recipe"]]
        ax.set_title(f"{FAMILIES[family]}, {recipe}\nseed {cell['seed']}: classifier-FD {cell['classifier_fd']:.0f}",
                     fontsize=9)
        ax.axis("off")

    ax = fig.add_subplot(grid[:, 3])
    width = 0.8 / len(RECIPES)
    for j, (recipe, label) in enumerate(RECIPES.items()):
        xs, means, errs = [], [], []
        for i, family in enumerate(FAMILIES):
            s = fds.get((family, recipe))
            if s and s["mean"] is not None:
                xs.append(i + (j - (len(RECIPES) - 1) / 2) * width)
                means.append(s["mean"])
                errs.append(s["ci95"] or 0.0)
        ax.bar(xs, means, width, yerr=errs, capsize=3, color=f"C{j}", edgecolor="black", linewidth=0.5, label=label)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room for the legend above the tallest bar
    seeds = sorted({len(v) for v in cells.values()})
    ax.set_xticks(range(len(FAMILIES)), list(FAMILIES.values()))
    ax.set_ylabel("classifier-FD at equal compute (lower is better)")
    ax.set_title(f"Fashion-MNIST, 256 tokens: mean and 95% interval over {'/'.join(map(str, seeds))} seeds", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left")
    fig.suptitle("Samples of each family's best recipe (one row per class) and every recipe's score at equal compute",
                 fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.bench.figure", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("docs/bench/fashion"),
                        help="a bench's results_dir: cells/*.json and samples/<cell>.png (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("docs/figures/front.png"), help="PNG (default: %(default)s)")
    args = parser.parse_args(argv)
    draw(args.results, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
