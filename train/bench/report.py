"""The table: one row per (backbone, routing), averaged over seeds, as markdown, CSV and JSON."""

from __future__ import annotations

import csv
from pathlib import Path

from train.bench import recipes
from train.bench.cells import Cell, cell_key, recipe_label
from train.bench.cost import speedups
from train.bench.quality import STALL
from train.bench.stats import summary, verdict, welch_difference
from train.bench.store import write_json_atomic

QUALITY = ("train_steps", "train_seconds", "images_per_s", "stalled_seconds", "ema_loss", "classifier_fd", "class_accuracy",
           "at_step_ema_loss", "at_step_classifier_fd", "at_step_class_accuracy", "experts_per_token_inference",
           "activated_params_inference")
# Columns compared routed vs unrouted, and whether lower is better.
COMPARED = {"ema_loss": True, "classifier_fd": True, "class_accuracy": False,
            "at_step_ema_loss": True, "at_step_classifier_fd": True, "at_step_class_accuracy": False}
NOISY = 0.1  # share of a cell's budget lost to stalls above which the table flags the cell


def _compare(row: dict, prefix: str, mine: list[dict], theirs: list[dict] | None) -> None:
    """Welch differences mine - theirs of every compared column into row[f"{key}{prefix}diff"], ..., and verdicts."""
    if not theirs or len(mine) < 2:
        return
    for key, lower in COMPARED.items():
        d = welch_difference([q.get(key) for q in mine], [q.get(key) for q in theirs])
        if d["low"] is not None:
            row[f"{key}{prefix}diff"], row[f"{key}{prefix}diff_low"], row[f"{key}{prefix}diff_high"] = d["diff"], d["low"], d["high"]
            row[f"{key}{prefix}verdict"] = verdict(d, lower)


def table_rows(pairs: list[Cell], costs: dict, runs: dict[str, list[dict]], baselines: dict | None = None) -> list[dict]:
    """One row per (backbone, routing): cost columns and quality columns averaged over seeds.

    Routed rows are compared with the same backbone unrouted; a row named in `baselines` (row -> baseline row,
    e.g. the MoE rows -> dit, their dense baseline) also with its baseline under the same routing.
    """
    rows = []
    for cell in pairs:
        cost = costs[cell.key]
        quality = runs[cell.key]
        row = {
            "backbone": cell.backbone, "routing": cell.routing, "align": cell.align, "align_label": cell.align_label or cell.align,
            "kind": "ablation" if cell.ablation else ("sprint" if any(r.get("mode") == "sprint" for r in cell.cfg.routing.routes)
                                                      else "routed" if cell.cfg.routing.routes else "baseline"),
            "params": cost["params"], "activated_params": cost.get("activated_params", cost["params"]), "tokens": cost["tokens"],
            "gflops_per_step": cost["flops"] / 1e9,
            **speedups(costs.get(f"{cell.backbone}-none"), cost),
            "step_ms": cost["step_seconds"] * 1e3,
            "saved_activation_mb": cost["saved_activation_bytes"] / 2**20,
            "peak_memory_mb": None if cost["peak_memory_bytes"] is None else cost["peak_memory_bytes"] / 2**20,
            "seeds": len(quality),
        }
        # Keys a mode does not measure (no matched-step scores, one seed) are left out rather than left empty.
        for key in QUALITY:
            s = summary([q.get(key) for q in quality])
            if s["mean"] is not None:
                row[key] = s["mean"]
            if s["std"] is not None:
                row[f"{key}_std"], row[f"{key}_ci95"] = s["std"], s["ci95"]
        for key in (*COMPARED, "train_steps"):  # per seed, for the recipe comparisons (train/bench/recipes.py)
            row[f"{key}_seeds"] = [q.get(key) for q in quality]
        row["cell_seeds"] = [q.get("seed") for q in quality]
        # Without MoE layers a token activates every weight, at sampling as in training.
        row.setdefault("activated_params_inference", row["activated_params"])
        if quality and quality[0].get("at_step") is not None:
            row["at_step"] = quality[0]["at_step"]
        if cell.routing != "none":
            _compare(row, "_", quality, runs.get(f"{cell.backbone}-none"))
        baseline = (baselines or {}).get(cell.backbone)
        if baseline is not None:
            row["baseline"] = baseline
            _compare(row, "_vs_base_", quality, runs.get(cell_key(baseline, cell.routing, cell.align)))
        row["noisy"] = any(q["stalled_seconds"] > NOISY * q["train_seconds"] for q in quality)
        rows.append(row)
    return rows


COLUMNS = {  # key: (markdown header, format)
    "backbone": ("backbone", "{}"), "routing": ("routing", "{}"), "align": ("alignment", "{}"), "kind": ("kind", "{}"),
    "params": ("params", "{:,}"), "activated_params": ("activated params / token (8)", "{:,.0f}"),
    "gflops_per_step": ("GFLOPs / step (1)", "{:.2f}"),
    "ideal_speedup": ("FLOP-ideal speedup", "{:.2f}x"), "measured_speedup": ("measured speedup (2)", "{:.2f}x"),
    "efficiency": ("efficiency", "{:.2f}"), "step_ms": ("step ms", "{:.0f}"),
    "saved_activation_mb": ("saved activations MB (3)", "{:.1f}"), "peak_memory_mb": ("peak memory MB", "{:.0f}"),
    "seeds": ("seeds", "{}"), "train_steps": ("steps in budget (4)", "{:.0f}"), "images_per_s": ("img/s", "{:.0f}"),
    "ema_loss": ("EMA loss (5)", "{:.4f}"), "classifier_fd": ("classifier-FD (6)", "{:.2f}"),
    "class_accuracy": ("class accuracy (6)", "{:.1%}"),
    "at_step": ("matched step (7)", "{}"), "at_step_ema_loss": ("EMA loss @ step", "{:.4f}"),
    "at_step_classifier_fd": ("classifier-FD @ step", "{:.2f}"), "at_step_class_accuracy": ("class accuracy @ step", "{:.1%}"),
    "experts_per_token_inference": ("experts / token, sampling (8)", "{:.2f}"),
    "activated_params_inference": ("activated params / token, sampling (8)", "{:,.0f}"),
}
OPTIONAL = ("at_step", "at_step_ema_loss", "at_step_classifier_fd", "at_step_class_accuracy",
            "experts_per_token_inference")  # shown when measured
MOE = ("activated_params", "experts_per_token_inference", "activated_params_inference")  # shown for tables with MoE rows


def _cell_text(row: dict, key: str, stalled: str) -> str:
    value = row.get(key)
    if value is None:
        return "n/a"
    text = COLUMNS[key][1].format(value)
    # With several seeds: mean ± the half-width of its 95% t-interval (the std is in table.csv / table.json).
    half = row.get(f"{key}_ci95")
    text = text if half is None else f"{text} ± {COLUMNS[key][1].format(half)}"
    return f"{text} †" if key == stalled and row["noisy"] else text


def markdown(rows: list[dict], meta: dict) -> str:
    m = meta
    moe = any(r["activated_params"] != r["params"] for r in rows)
    aligned = any(r.get("align", "none") != "none" for r in rows)  # the alignment column only once a table has aligned rows
    columns = [k for k in COLUMNS if (k not in OPTIONAL or any(k in r for r in rows)) and (k not in MOE or moe)
               and (k != "align" or aligned)]
    lines = [f"| {' | '.join(COLUMNS[k][0] for k in columns)} |", "|" + "---|" * len(columns)]
    # A stall costs a wall-clock budget steps, and a step budget only time.
    stalled = "train_steps" if m["train"].get("wall_clock") else "images_per_s"
    lines += [f"| {' | '.join(_cell_text(r | {'align': r.get('align_label') or r.get('align')}, k, stalled) for k in columns)} |" for r in rows]
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
        f"round-robin over all cells so that machine noise hits every cell alike, in {t.get('clock', 'wall-clock time')}; "
        "speedup = unrouted step time / step time. Efficiency = measured / FLOP-ideal.",
        "(3) Bytes of the tensors autograd saves for backward in one forward (saved-tensor hooks, weights excluded). "
        "Peak memory is measured on CUDA only.",
        f"(4) Quality columns: the real Trainer for {q['budget']} per cell on {q['data']} ({q['tokens']} tokens), "
        f"batch {q['batch_size']}, seeds {q['seeds']}; ablation = routing.allow_unstructured=true (a random subset "
        f"without a grid on a scan-order backbone). † more than {NOISY:.0%} of the budget went to steps slower than "
        f"{STALL:g}x the cell's median step (another job on the machine): "
        + ("that cell trained fewer steps than it could have; delete its cells/<cell>.json and re-run the command to "
           "redo it." if q.get("wall_clock") else
           "its step budget is unchanged, only its seconds and img/s read slow.")
        + (f" measured_only=true: the rows hold the seeds measured so far; not measured yet: {', '.join(q['missing'])}."
           if q.get("missing") else ""),
        f"(5) {q.get('objective', 'edm').upper()} loss of the EMA model (eval mode, unrouted) on a fixed batch of "
        f"{e['loss_batch']} images ({e['reference']}) with fixed noise levels and noise, identical for every cell.",
        f"(6) {e['samples']} class-conditional samples (Heun, {e['steps']} steps, guidance {e['guidance']}, seed "
        f"{e['seed']}) scored by a small CNN trained on {q['data']} (held-out accuracy {c['heldout_accuracy']:.1%}): "
        f"classifier-FD = Fréchet distance of its {c['config']['feature_dim']}-d penultimate features against {e['num_real']} real "
        "images (NOT Inception FID; comparable only within this table); class accuracy = share of samples classified "
        f"as the class they were asked for. Floor: {e.get('floor', str(e['samples']) + ' other real images')} score "
        f"classifier-FD {e['real_scores']['classifier_fd']:.2f} and class accuracy {e['real_scores']['class_accuracy']:.1%}.",
    ]
    if any("at_step" in r for r in rows):
        notes.append(f"(7) Quality against optimizer steps: the same scores for the EMA checkpoint at the step count the unrouted "
                     f"cell of the backbone trains (the trainer saves one every {e['every']} steps; held-out EMA loss of every "
                     "checkpoint in quality_vs_steps.png), so routed and unrouted cells are also compared after equal updates.")
    if moe:
        notes.append("(8) Parameters a token activates: all of them minus the experts it does not use (gate and capacity "
                     "predictor included). In training: top_k experts per MoE layer (token choice) or C (expert choice, global "
                     "pool). While sampling: measured, the mean number of experts per token over every network evaluation of the "
                     "scored samples (DiffMoE's dynamic capacity from its learned thresholds).")
    if aligned:
        notes.append("(9) Aligned rows (alignment column): the training step includes the alignment, i.e. the EMA teacher's forward "
                     "up to its block without gradient and the projector's forward and backward, in the FLOPs, the step time and so "
                     "the equal-compute step budget; their speedups are against the same backbone unrouted and unaligned, timed in "
                     "the same rounds (cost-<align>.json). params count the model only (the projector is dropped after training).")
    if any(r.get("seeds", 1) > 1 for r in rows):
        notes.append(f"With {max(r['seeds'] for r in rows)} seeds, a value reads mean ± the half-width of its 95% Student-t interval "
                     "(n - 1 degrees of freedom); table.csv and table.json hold the std too.")
    routed = comparison(rows, "_", "Routed minus unrouted (same backbone)")
    against_base = comparison(rows, "_vs_base_", "Each row minus its baseline row under the same routing (the MoE rows minus "
                                                 "dit, the dense baseline at the same activated parameters)", baseline=True)
    return "\n".join(lines + notes + routed + against_base + recipes.markdown(rows)) + "\n"


def comparison(rows: list[dict], prefix: str, title: str, baseline: bool = False) -> list[str]:
    """Differences stored under `prefix` (table_rows), with Welch 95% intervals and a verdict (lines of markdown)."""
    compared = [r for r in rows if any(f"{k}{prefix}verdict" in r for k in COMPARED)]
    if not compared:
        return []
    keys = [k for k in COMPARED if any(f"{k}{prefix}verdict" in r for r in compared)]
    lines = ["", f"{title}: mean difference [95% Welch interval], and the verdict: wins / loses when the interval excludes 0, "
             "else ties.", "",
             f"| backbone | {'baseline | ' if baseline else ''}routing | "
             + " | ".join(COLUMNS[k][0].replace(" (5)", "").replace(" (6)", "") for k in keys) + " |",
             "|---|---|" + ("---|" if baseline else "") + "---|" * len(keys)]
    for r in compared:
        cells = []
        for k in keys:
            if f"{k}{prefix}verdict" not in r:
                cells.append("n/a")
                continue
            fmt = "{:+.2f}" if "fd" in k else ("{:+.1%}" if "accuracy" in k else "{:+.4f}")
            cells.append(f"{fmt.format(r[f'{k}{prefix}diff'])} [{fmt.format(r[f'{k}{prefix}diff_low'])}, "
                         f"{fmt.format(r[f'{k}{prefix}diff_high'])}] {r[f'{k}{prefix}verdict']}")
        recipe = recipe_label(r["routing"], r.get("align_label") or r.get("align", "none"))
        lines.append(f"| {r['backbone']} | {r['baseline'] + ' | ' if baseline else ''}{recipe} | " + " | ".join(cells) + " |")
    return lines


def write_tables(rows: list[dict], meta: dict, out: Path) -> str:
    text = markdown(rows, meta)
    (out / "table.md").write_text(text)
    write_json_atomic(out / "table.json", {"meta": meta, "rows": rows})
    keys = list(dict.fromkeys(k for r in rows for k in r if not k.endswith("_seeds")))  # per-seed lists: table.json only
    with (out / "table.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows({k: "n/a" if r.get(k) is None else r[k] for k in keys if not k.endswith("_seeds")} for r in rows)
    return text
