"""Guidance rules at matched FLOPs, each at its best swept scale (the sampling study's `--match-flops`).

A guidance rule costs more or less per sampler step than CFG (two full evaluations): path-drop guidance's weak
branch skips the sparse middle, routing guidance's weak branch processes fewer tokens. Compared at one step count
the cheaper rule is simply handicapped; compared at one FLOP budget per image, the cheaper rule spends its saving
on more sampler steps. Each rule's step count is the largest whose FLOPs per image stay within the budget.
"""

from __future__ import annotations

from collections.abc import Callable

from train.bench.stats import summary, verdict

GUIDED = ("cfg", "pdg", "rg")  # the kinds the best-scale table compares; CFG is the reference rule


def matched_steps(flops_at: Callable[[int], int], budget: int, start: int) -> int:
    """The most sampler steps whose FLOPs per image stay within `budget` (at least 1); FLOPs grow with steps."""
    low, high = 1, max(start, 1)
    while flops_at(high) <= budget:  # grow until over the budget
        low, high = high, high * 2
    while high - low > 1:  # flops_at(low) <= budget < flops_at(high), or low == 1
        mid = (low + high) // 2
        low, high = (mid, high) if flops_at(mid) <= budget else (low, mid)
    return low


def best_per_kind(agg: list[dict]) -> list[dict]:
    """Per group and guidance kind, the rule (scale) with the lowest mean classifier-FD, among the rules measured on
    every run of the group: pooled studies may sweep a scale on one seed only, and a mean over fewer runs is no match."""
    out = []
    for group in dict.fromkeys(a["group"] for a in agg):
        complete = max(a.get("runs", 1) for a in agg if a["group"] == group)
        for kind in GUIDED:
            mine = [a for a in agg if a["group"] == group and a["kind"] == kind and a.get("runs", 1) == complete]
            if mine:
                out.append(min(mine, key=lambda a: a["classifier_fd"]))
    return out


def against_cfg(rows: list[dict], best: list[dict]) -> list[dict]:
    """Each group's best PDG and best RG rule minus its best CFG rule, paired over runs (same run, same seed)."""
    out = []
    for group in dict.fromkeys(b["group"] for b in best):
        cfg = next((b for b in best if b["group"] == group and b["kind"] == "cfg"), None)
        if cfg is None:
            continue
        for other in (b for b in best if b["group"] == group and b["kind"] != "cfg"):
            pairs = {}
            for r in rows:
                if r["group"] == group and r["rule"] in (cfg["rule"], other["rule"]):
                    pairs.setdefault(r["run"], {})[r["rule"]] = r
            pairs = [p for p in pairs.values() if len(p) == 2]
            line = {"group": group, "rule": other["rule"], "cfg_rule": cfg["rule"], "runs": len(pairs),
                    "gflops_per_image": other["gflops_per_image"], "cfg_gflops_per_image": cfg["gflops_per_image"]}
            for key, lower in (("classifier_fd", True), ("class_accuracy", False)):
                d = summary([p[other["rule"]][key] - p[cfg["rule"]][key] for p in pairs])
                half = d["ci95"]
                line[key] = {"diff": d["mean"], "ci95": half,
                             "verdict": verdict({"low": None if half is None else d["mean"] - half,
                                                 "high": None if half is None else d["mean"] + half}, lower)}
            out.append(line)
    return out


def markdown(best: list[dict], versus: list[dict]) -> list[str]:
    lines = ["", "Each guidance rule at its best swept scale (lowest mean classifier-FD):", "",
             "| group | kind | best rule | sampler steps | GFLOPs / image | classifier-FD | class accuracy |", "|---|---|---|---|---|---|---|"]
    for b in best:
        ci = "" if b["classifier_fd_ci95"] is None else f" ± {b['classifier_fd_ci95']:.2f}"
        lines.append(f"| {b['group']} | {b['kind']} | {b['rule']} | {b.get('sampler_steps', '')} | {b['gflops_per_image']:.3f} | "
                     f"{b['classifier_fd']:.2f}{ci} | {b['class_accuracy']:.1%} |")
    if versus:
        lines += ["", "Best rule minus best CFG, paired over runs (95% t-interval; wins / loses when it excludes 0):", "",
                  "| group | rule | vs | runs | GFLOPs / image (vs CFG's) | classifier-FD | class accuracy |", "|---|---|---|---|---|---|---|"]
        for v in versus:
            cells = []
            for key, fmt in (("classifier_fd", "{:+.2f}"), ("class_accuracy", "{:+.1%}")):
                d = v[key]
                if d["diff"] is None:
                    cells.append("")
                    continue
                half = "" if d["ci95"] is None else f" ± {fmt.replace('+', '').format(d['ci95'])}"
                cells.append(f"{fmt.format(d['diff'])}{half} {d['verdict']}")
            lines.append(f"| {v['group']} | {v['rule']} | {v['cfg_rule']} | {v['runs']} | {v['gflops_per_image']:.3f} "
                         f"({v['cfg_gflops_per_image']:.3f}) | {' | '.join(cells)} |")
    return lines
