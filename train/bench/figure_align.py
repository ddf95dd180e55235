"""The alignment figure: held-out EMA loss of every family x recipe, unaligned and at SRA's settings, against steps;
and the table of docs/alignment.md beside it.

    python -m train.bench.figure_align            # docs/figures/alignment_sra.png from the committed cells (seconds)
    python -m train.bench.figure_align --results docs/bench/fashion --align sra --out alignment.png
    python -m train.bench.figure_align --table --also self   # the markdown table, with a column for weight 2's cells

Reads only the Fashion-MNIST bench's committed cell files (docs/alignment.md, "Rerun at SRA's settings"): each cell's
quality curve, the held-out EMA loss of its checkpoints every 100 steps. One panel per family (columns) and recipe
(rows); in each, the unaligned pair and the aligned one, mean over seeds at the steps every seed reached, with the
seeds' min-max band. Both train the same compute, so the aligned line, whose step also runs the EMA teacher, ends at
fewer steps: where the two lines overlap, alignment ties step for step, and the gap between their last points is what
it costs at equal compute.

The table: per pair, aligned minus unaligned at equal compute (classifier-FD, held-out EMA loss) and at the last step
every cell of the pair reached (held-out EMA loss from the quality curves), with 95% Welch intervals over the seeds
(train/bench/stats.py); `--also` adds another alignment's classifier-FD difference as a last column.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from statistics import fmean

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers
import matplotlib.pyplot as plt  # noqa: E402

from routing import ConfigError  # noqa: E402
from train.bench.figure import FAMILIES, load_cell, recipe_routing  # noqa: E402
from train.bench.stats import verdict, welch_difference  # noqa: E402
from train.cli import friendly_errors  # noqa: E402

RECIPES = {"none": "unrouted", "tread": "TREAD", "sprint": "SPRINT"}
FIRST_STEP = 300  # earlier checkpoints' losses are several times the last ones and would flatten the part that differs


def read_pairs(cells: Path, align: str) -> dict[tuple[str, str], dict[str, list[dict]]]:
    """{(family, recipe): {"none": unaligned cells, align: aligned cells}}, one dict per seed, for pairs with both."""
    found: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for family in FAMILIES:
        for recipe in RECIPES:
            routing = recipe_routing(family, recipe)
            sides = {side: [load_cell(p) for p in sorted(cells.glob("*.json"))
                            if re.fullmatch(rf"{family}-{routing}{re.escape(suffix)}-s\d+", p.stem)]
                     for side, suffix in (("none", ""), (align, f"-{align}"))}
            if all(sides.values()):
                found[(family, recipe)] = sides
            unscored = [c["cell"] for cs in sides.values() for c in cs if not c.get("quality_curve", {}).get("step")]
            if unscored:
                raise ConfigError(f"cell {unscored[0]} in {cells} has no quality curve (it was measured with "
                                  "eval.every=0); measure it again with the bench's eval.every set (fashion: 100).")
    return found


def measured_pairs(results: Path, align: str) -> dict[tuple[str, str], dict[str, list[dict]]]:
    """read_pairs, refused in one sentence when no pair was measured with `align`."""
    pairs = read_pairs(results / "cells", align)
    if not pairs:
        raise ConfigError(f"no family x recipe in {results / 'cells'} has both unaligned cells and cells named "
                          f"'<family>-<routing>-{align}-s<seed>.json'; point --results at a bench's results_dir "
                          "(docs/bench/fashion holds the committed ones) and --align at an alignment it measured (e.g. sra).")
    return pairs


def mean_curve(cells: list[dict]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps from FIRST_STEP that every seed reached, and the mean, min and max over seeds of the held-out EMA loss at each."""
    curves = [c["quality_curve"] for c in cells]
    steps = sorted(s for s in set.intersection(*(set(q["step"]) for q in curves)) if s >= FIRST_STEP)
    losses = [[q["ema_loss"][q["step"].index(s)] for q in curves] for s in steps]  # (steps, seeds)
    return steps, [fmean(v) for v in losses], [min(v) for v in losses], [max(v) for v in losses]


def _difference(mine: list[float], theirs: list[float], digits: int) -> str:
    d = welch_difference(mine, theirs)
    if d["low"] is None:
        return "n/a (one seed)" if d["diff"] is not None else "n/a"
    return f"{d['diff']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}] {verdict(d, True)}"


def table(results: Path, align: str, also: str | None = None) -> str:
    """The markdown table of docs/alignment.md's rerun: one row per family x recipe measured with `align`."""
    pairs = measured_pairs(results, align)
    others = read_pairs(results / "cells", also) if also else {}
    head = ["family, recipe", "seeds", f"steps, unaligned / {align}", f"classifier-FD, unaligned / {align}",
            f"{align} minus unaligned: classifier-FD", "held-out EMA loss", "matched step: EMA loss"]
    head += [f"{also} minus unaligned: classifier-FD"] if also else []
    lines = [f"| {' | '.join(head)} |", "|" + " --- |" * len(head)]
    for (family, recipe), sides in pairs.items():
        base, aligned = sides["none"], sides[align]
        step = max(set.intersection(*(set(c["quality_curve"]["step"]) for c in base + aligned)))
        at = lambda cells: [c["quality_curve"]["ema_loss"][c["quality_curve"]["step"].index(step)] for c in cells]  # noqa: E731
        row = [f"{family}-{base[0]['routing']}", str(len(aligned)), f"{base[0]['train_steps']:,} / {aligned[0]['train_steps']:,}",
               f"{fmean(c['classifier_fd'] for c in base):.1f} / {fmean(c['classifier_fd'] for c in aligned):.1f}",
               _difference([c["classifier_fd"] for c in aligned], [c["classifier_fd"] for c in base], 1),
               _difference([c["ema_loss"] for c in aligned], [c["ema_loss"] for c in base], 4),
               f"{_difference(at(aligned), at(base), 4)} (step {step:,})"]
        if also:
            other = others.get((family, recipe), {}).get(also, [])
            row.append(_difference([c["classifier_fd"] for c in other], [c["classifier_fd"] for c in base], 1))
        lines.append(f"| {' | '.join(row)} |")
    return "\n".join(lines)


def draw(results: Path, align: str, out: Path) -> None:
    pairs = measured_pairs(results, align)
    fig, axes = plt.subplots(len(RECIPES), len(FAMILIES), figsize=(3.4 * len(FAMILIES), 2.7 * len(RECIPES)), squeeze=False)
    for (i, recipe), (j, family) in ((r, f) for r in enumerate(RECIPES) for f in enumerate(FAMILIES)):
        ax = axes[i][j]
        sides = pairs.get((family, recipe))
        if sides is None:
            ax.set_axis_off()
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
            continue
        for k, (side, cells) in enumerate(sides.items()):
            steps, mean, low, high = mean_curve(cells)
            label = "unaligned" if side == "none" else f"align={align}"
            ax.plot(steps, mean, color=f"C{k}", linestyle="-" if side == "none" else "--", linewidth=1.4,
                    label=f"{label} ({len(cells)} seeds)")
            ax.fill_between(steps, low, high, color=f"C{k}", alpha=0.15)
            ax.plot(steps[-1], mean[-1], "o", color=f"C{k}", markersize=4)  # the end of the equal-compute budget
        per_step = sides["none"][0]["train_steps"] / sides[align][0]["train_steps"]
        ax.set_title(f"{FAMILIES[family]}, {RECIPES[recipe]}{f' ({recipe_routing(family, recipe)})' if recipe == 'tread' else ''}\n"
                     f"aligned step costs {per_step:.2f}x", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, loc="upper right")
        if i == len(RECIPES) - 1:
            ax.set_xlabel("optimizer steps (batch 16)", fontsize=8)
        if j == 0:
            ax.set_ylabel("held-out EMA loss", fontsize=8)
    fig.suptitle(f"align={align} against unaligned at equal compute (Fashion-MNIST, 256 tokens; mean over seeds, band "
                 f"min-max; from step {FIRST_STEP}; a dot ends each budget)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.bench.figure_align", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("docs/bench/fashion"),
                        help="a bench's results_dir holding cells/*.json (default: %(default)s)")
    parser.add_argument("--align", default="sra", help="the aligned cells' name in the grid (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("docs/figures/alignment_sra.png"), help="PNG (default: %(default)s)")
    parser.add_argument("--table", action="store_true", help="print the markdown table instead of drawing the figure")
    parser.add_argument("--also", help="--table: another alignment's cells (e.g. self) as a last column")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.results, args.align, args.also))
        return
    draw(args.results, args.align, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
