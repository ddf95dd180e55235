"""The table: one row per (backbone, routing), averaged over seeds, as markdown, CSV and JSON."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from train.bench.cells import Cell
from train.bench.cost import speedups
from train.bench.quality import STALL
from train.bench.store import write_json_atomic

QUALITY = ("train_steps", "images_per_s", "stalled_seconds", "ema_loss", "classifier_fd", "class_accuracy")
NOISY = 0.1  # share of a cell's budget lost to stalls above which the table flags the cell


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
