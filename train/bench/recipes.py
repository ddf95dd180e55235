"""Which recipe wins, per family: every recipe's scores side by side, the best against the runner-up, and the
recipes against each other (TREAD with its usual selection, TREAD with structured selection, SPRINT), each with a
95% Welch interval over the seeds; and, once a grid has aligned rows (grid.aligns), whether alignment adds to each
recipe. Reads the per-seed values `table_rows` stores with every row."""

from __future__ import annotations

import statistics

from train.bench.stats import verdict, welch_difference

ROUTINGS = ("none", "random", "rows", "structured", "sprint")
# (key, label, lower is better, format)
METRICS = (
    ("classifier_fd", "classifier-FD, equal compute", True, "{:.1f}"),
    ("class_accuracy", "class accuracy, equal compute", False, "{:.1%}"),
    ("ema_loss", "held-out EMA loss, equal compute", True, "{:.4f}"),  # far less seed noise than 200 samples' FD
    ("at_step_ema_loss", "held-out EMA loss, matched step", True, "{:.4f}"),
    ("at_step_classifier_fd", "classifier-FD, matched step", True, "{:.1f}"),
)


def _values(row: dict, key: str) -> list[float]:
    return [v for v in row.get(f"{key}_seeds") or [] if v is not None]


def usual_tread(rows: list[dict]) -> dict | None:
    """A family's TREAD row with its usual selection: random for attention, rows for scan-order models (where random
    is only the 1-D ablation)."""
    return next((r for name in ("random", "rows") for r in rows if r["routing"] == name and r["kind"] != "ablation"), None)


def _diff_text(a: list[float], b: list[float], lower: bool, fmt: str) -> str:
    d = welch_difference(a, b)
    if d["diff"] is None:
        return "n/a"
    sign = fmt.replace("{:", "{:+")
    span = "" if d["low"] is None else f" [{sign.format(d['low'])}, {sign.format(d['high'])}]"
    return f"{sign.format(d['diff'])}{span} {verdict(d, lower)}"


def markdown(rows: list[dict]) -> list[str]:
    return recipes([r for r in rows if r.get("align", "none") == "none"]) + alignment(rows)


def alignment(rows: list[dict]) -> list[str]:
    """Whether alignment adds to each recipe, per family: every aligned row minus the same backbone and recipe
    unaligned (none: alignment alone; TREAD, SPRINT: alignment on top of routing), with a 95% Welch interval over the
    seeds: wins when the interval excludes 0 in alignment's favour, loses the other way, else a tie within the seed
    spread."""
    aligned = [r for r in rows if r.get("align", "none") != "none"]
    plain = {(r["backbone"], r["routing"]): r for r in rows if r.get("align", "none") == "none"}
    compared = [(a, plain[(a["backbone"], a["routing"])]) for a in aligned if (a["backbone"], a["routing"]) in plain]
    if not compared:
        return []
    lines = ["", "Does alignment add to routing, per family (aligned minus the same recipe unaligned, 95% Welch interval over "
             "seeds; wins / loses when the interval excludes 0, else ties: no difference beyond the seed spread):", "",
             "| family | comparison | " + " | ".join(label for _, label, _, _ in METRICS) + " |", "|---|---|" + "---|" * len(METRICS)]
    for a, b in compared:
        cells = [_diff_text(_values(a, key), _values(b, key), lower, fmt) for key, _, lower, fmt in METRICS]
        lines.append(f"| {a['backbone']} | {a['routing']} + {a.get('align_label') or a['align']} - {b['routing']} | {' | '.join(cells)} |")
    return lines + per_seed(aligned)


def recipes(rows: list[dict]) -> list[str]:
    families = list(dict.fromkeys(r["backbone"] for r in rows if r["routing"] in ROUTINGS))
    present = [name for name in ROUTINGS if any(r["routing"] == name for r in rows)]
    if not any(r["routing"] in ("structured", "sprint") for r in rows):
        return []
    lines = ["", "Which recipe wins, per family: mean ± 95% t-interval over seeds (n in brackets); the best recipe minus the "
             "runner-up with its 95% Welch interval: wins when the interval excludes 0, else ties.", "",
             f"| family | metric | {' | '.join(present)} | best | best minus runner-up |", "|---|---|" + "---|" * (len(present) + 2)]
    for family in families:
        mine = {r["routing"]: r for r in rows if r["backbone"] == family and r["kind"] != "ablation"}
        for key, label, lower, fmt in METRICS:
            scored = {name: _values(r, key) for name, r in mine.items() if _values(r, key)}
            if len(scored) < 2:
                continue
            cells = []
            for name in present:
                v = scored.get(name)
                ci = mine[name].get(f"{key}_ci95") if v else None
                cells.append("" if not v else fmt.format(statistics.fmean(v)) + (f" ± {fmt.format(ci)}" if ci else "") + f" ({len(v)})")
            ranked = sorted(scored, key=lambda n: statistics.fmean(scored[n]), reverse=not lower)
            best, second = ranked[0], ranked[1]
            lines.append(f"| {family} | {label} | {' | '.join(cells)} | {best} | "
                         f"{_diff_text(scored[best], scored[second], lower, fmt)} (vs {second}) |")
    lines += ["", "Recipe against recipe, per family (first minus second, 95% Welch interval):", "",
              "| family | comparison | " + " | ".join(label for _, label, _, _ in METRICS) + " |", "|---|---|" + "---|" * len(METRICS)]
    for family in families:
        mine = [r for r in rows if r["backbone"] == family]
        tread = usual_tread(mine)
        by_name = {r["routing"]: r for r in mine}
        pairs = [(by_name.get("structured"), tread), (by_name.get("sprint"), tread), (by_name.get("sprint"), by_name.get("structured"))]
        for a, b in pairs:
            if a is None or b is None:
                continue
            cells = [_diff_text(_values(a, key), _values(b, key), lower, fmt) for key, _, lower, fmt in METRICS]
            lines.append(f"| {family} | {a['routing']} - {b['routing']} | {' | '.join(cells)} |")
    return lines + per_seed([r for r in rows if r["backbone"] in families])


PER_SEED = (("train_steps", "{:.0f}"), ("ema_loss", "{:.4f}"), ("classifier_fd", "{:.1f}"), ("class_accuracy", "{:.1%}"),
            ("at_step_ema_loss", "{:.4f}"), ("at_step_classifier_fd", "{:.1f}"), ("at_step_class_accuracy", "{:.1%}"))


def per_seed(rows: list[dict]) -> list[str]:
    """Every seed's scores, so a mean can be read against the values it averages (seeds separated by /)."""
    lines = ["", "Per seed (equal compute: steps, held-out EMA loss, classifier-FD, class accuracy; then the same at the "
             "unrouted step count):", "", "| cell | steps | EMA loss | classifier-FD | class acc. | @ step: EMA loss | FD | acc. |",
             "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r.get("cell_seeds")):
        key = f"{r['backbone']}-{r['routing']}" + ("" if r.get("align", "none") == "none" else f"-{r['align']}")
        name = f"{key}-" + " / ".join(f"s{s}" for s in r["cell_seeds"])
        cells = []
        for key, fmt in PER_SEED:
            values = [fmt.format(v) if v is not None else "n/a" for v in r.get(f"{key}_seeds") or []]
            same_budget = key == "train_steps" and len(set(values)) == 1  # every seed of a row trains the same steps
            cells.append(values[0] if same_budget else " / ".join(values))
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines if len(lines) > 5 else []
