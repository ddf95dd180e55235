"""The report of `python -m train.bench.gpu`: the machine it ran on, every section's records, the issue goals
they measure, and what was skipped; one markdown file and one JSON file with the same content."""

from __future__ import annotations

import json
import math
import platform
import subprocess
from pathlib import Path

import torch

from train.bench import scaling
from train.bench.gpu_profile import markdown as profile_lines
from train.bench.spread import ROUNDS, ratio_range, spread, verdict
from train.files import write_atomic

ROOT = Path(__file__).resolve().parents[2]


def environment(device: torch.device) -> dict:
    """Device, library versions and the commit, so a report can be told from any other."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - the report says so; the kernel sections will fail on their own
        triton_version = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, torch threads: {torch.get_num_threads()})"
    return {"device": name, "device_type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton_version, "python": platform.python_version(), "commit": _commit()}


def _commit() -> str | None:
    """HEAD, with "+changes" when tracked files differ from it (None outside a git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def goals(sections: list[dict], dry_run: bool) -> list[dict]:
    """The goals of docs/performance.md the rows decide (issues 36, 37, 47), read by section name. Each has the
    median and range of its value over the row's rounds and a verdict (train/bench/spread.py): met when the whole
    range meets the goal, missed when the whole range misses it, undecided when it straddles it or rests on fewer
    than ROUNDS rounds, not measured without a row. A dry run's tiny shapes decide none ("not measured").
    `met` keeps the older reading: True, False, or None for the other verdicts."""
    measured = [r for s in sections if s["status"] == "measured" for r in _records(s) if "error" not in r]
    rows = {r["section"]: r for r in measured}  # one row per section, except the kernels'
    kernels = {(r["kernel"], r["precision"]): r for r in measured if "ms_fwd_bwd" in r}

    def goal(text: str, value: dict, bound: float, fmt: str, at_most: bool = False, note: str = "", once: bool = False,
             detail: str = "") -> dict:
        """`note`: why the value decides nothing (undecided whatever it reads); `once`: a value measured once by
        design (a compile), decided on its own; `detail`: what the note adds of how it was measured."""
        rule = verdict(value["low"], value["high"], bound, at_most)
        if rule != "not measured" and note:
            rule = "undecided"
        elif rule != "not measured" and value["n"] < ROUNDS and not once:
            rule, note = "undecided", f"{value['n']} round(s), fewer than {ROUNDS}"
        elif once and value["n"]:
            note = "measured once (a compile is not repeated)"
        note = "; ".join(x for x in (note, detail if value["n"] else "") if x)
        # A dry run applies the rule to its tiny shapes' rounds (`rule`, to check the command) and decides nothing.
        decided = "not measured" if dry_run else rule
        shown = None if value["median"] is None else f"{value['median']:{fmt}}"
        return {"goal": text, "measured": shown, "median": value["median"], "low": value["low"], "high": value["high"],
                "n": value["n"], "range": None if value["low"] is None else f"{value['low']:{fmt}}-{value['high']:{fmt}}",
                "verdict": decided, "rule": rule, "met": {"met": True, "missed": False}.get(decided), "note": note}

    def get(section: str, key: str) -> dict:
        return _spread(rows.get(section), key)

    xl_row = rows.get("dit-XL-tread", rows.get("dit-XL-official"))

    def xl(key: str) -> dict:  # DiT-XL/2 TREAD: its own row, else our side of the side-by-side (the same step)
        return get("dit-XL-tread", key) if "dit-XL-tread" in rows else get("dit-XL-official", key)

    out = []
    for name, ms in (("selective scan", 0.6), ("Bi-WKV", 0.4)):
        out.append(goal(f"{name}, bf16, forward+backward at the reference shape: at most {ms} ms",
                        _spread(kernels.get((name, "bf16")), "ms_fwd_bwd"), ms, ".3f", at_most=True))
    dit_mfu = get("dit-S", "mfu_routed")
    for section, model in (("rwkv-S", "RWKV-S/2"), ("mamba-S", "Mamba-S/2")):
        mfu = get(section, "mfu_routed")
        out.append(goal(f"{model} rows: routed MFU at least half of DiT-S/2's at batch 64 (ratio >= 0.5)",
                        ratio_range(_values(rows.get(section), "mfu_routed"), _values(rows.get("dit-S"), "mfu_routed"))
                        if mfu["n"] and dit_mfu["n"] else spread([]), 0.5, ".2f"))
        out.append(goal(f"{model} rows: routed efficiency >= 0.9", get(section, "efficiency"), 0.9, ".2f"))
    official_row = rows.get("dit-XL-official")
    unfair = "" if official_row is None or official_row.get("fair", True) else f"reported, not decided: {official_row['fairness']}"
    out += [goal("DiT-XL/2 TREAD: routed efficiency >= 0.9", xl("efficiency"), 0.9, ".2f"),
            goal("DiT-XL/2 TREAD, batch 64: unrouted MFU >= 45%", xl("mfu_unrouted"), 0.45, ".1%"),
            goal("DiT-XL/2 TREAD, batch 64: routed MFU >= 40%", xl("mfu_routed"), 0.40, ".1%"),
            goal("DiT-XL/2 TREAD: whole-model compile (the first unrouted and routed steps) under 90 s", xl("compile_s"), 90.0,
                 ".0f", at_most=True, once=True, detail=f"compile={_mode(xl_row)}" if xl_row and "compile" in xl_row else ""),
            goal("DiT-XL/2 TREAD, batch 128: unrouted MFU >= 45%", get("dit-XL-tread-b128", "mfu_unrouted"), 0.45, ".1%"),
            goal("DiT-XL/2 TREAD, batch 128: routed MFU >= 40%", get("dit-XL-tread-b128", "mfu_routed"), 0.40, ".1%"),
            goal("DiT-XL/2 SPRINT: routed efficiency >= 0.85", get("dit-XL-sprint", "efficiency"), 0.85, ".2f"),
            goal("DiT-B/2 TREAD: routed efficiency >= 0.9", get("dit-B-tread", "efficiency"), 0.9, ".2f"),
            goal("python -m train: at least 0.95 of the bare step's images/s", get("trainer", "ratio"), 0.95, ".2f"),
            goal("DiT-XL/2 TREAD beside CompVis/tread's DiT: routed step at most 0.8x the official one",
                 get("dit-XL-official", "ratio_routed"), 0.8, ".2f", at_most=True, note=unfair)]
    return out


def _values(row: dict | None, key: str) -> list:
    """A row's values of `key`: one per round where it kept its rounds, else its one value ([] without a row)."""
    if row is None or (row.get(key) is None and key not in row.get("rounds", {})):
        return []
    return list(row.get("rounds", {}).get(key) or [row[key]])


def _spread(row: dict | None, key: str) -> dict:
    if row is not None and key in row.get("spreads", {}):
        return row["spreads"][key]
    return spread(_values(row, key))


def _finite(value):
    """JSON has no inf or nan: they are written as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write(out: Path, report: dict) -> tuple[Path, Path]:
    """report.md and report.json in `out` (created), each written whole or not at all."""
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "report.md", out / "report.json"
    write_atomic(js, json.dumps(_finite(report), indent=1) + "\n")
    write_atomic(md, markdown(report))
    return md, js


def _f(value, fmt: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:{fmt}}{suffix}"


def _goal(row: dict) -> str:
    if row["goal_ms"] is None:
        return "-"
    verdict = "not decided" if row["goal_met"] is None else ("met" if row["goal_met"] else "**missed**")
    return f"{verdict} (<= {row['goal_ms']} ms)"


def _records(section: dict) -> list[dict]:
    """A section's records, with the bare DiT-B/2 TREAD step the trainer section measured when that row did not run."""
    return section["records"] + [r["bare_step"] for r in section["records"] if "bare_step" in r]


def _table_kind(section: dict, record: dict) -> str:
    return "steps" if record.get("section") == "dit-B-tread" else section["kind"]


def _mode(row: dict) -> str:
    """The compile column: the mode, with regions and CUDA graphs where the row used them."""
    return f"{row['compile']}{' +regions' if row.get('regions') else ''}{' +graphs' if row['cuda_graphs'] else ''}"


def _ranged(row: dict, key: str, fmt: str) -> str:
    """A cell: the median over the row's rounds and, with two or more, their range: "91.0 (90.2-93.1)"."""
    value = _spread(row, key)
    if value["median"] is None:
        return "-"
    if value["n"] < 2:
        return f"{value['median']:{fmt}}"
    return f"{value['median']:{fmt}} ({value['low']:{fmt}}-{value['high']:{fmt}})"


def _verdict(passed: bool) -> str:
    return "pass" if passed else "**FAIL**"


def _tuned_cell(tuned: dict[str, dict]) -> str:
    """One report cell: each kernel's pick and, when timed, its time against the slowest config's."""
    def part(kernel: str, t: dict) -> str:
        spread = f" ({min(t['ms'].values()):.3f} of {max(t['ms'].values()):.3f} ms, {len(t['ms'])} configs)" if t["ms"] else ""
        return f"{kernel}: {t['picked']}{spread}"

    return "; ".join(part(k, t) for k, t in tuned.items()) or "-"


TABLES = {
    "kernel_checks": ("| kernel | precision | shape | output error | worst gradient error | tolerance | result |",
                      lambda r: f"| {r['kernel']} | {r['precision']} | {r['shape']} | {_f(r['y_error'], '.1e')} | "
                                f"{_f(r['grad_error'], '.1e')} ({r['worst_grad']}) | {r['tolerance']:.0e} | {_verdict(r['passed'])} |"),
    "family_checks": ("| family | precision | shape | output error | worst gradient tensor | whole gradient | tolerance (output, gradient) | result |",
                      lambda r: f"| {r['family']} | {r['precision']} | {r['shape']} | {_f(r['output_error'], '.1e')} | "
                                f"{_f(r['grad_error'], '.1e')} ({r['worst_grad']}) | {_f(r['grad_norm_error'], '.1e')} | "
                                f"{r['tolerance'][0]:.0e}, {r['tolerance'][1]:.0e}{' per tensor' if r['precision'] == 'fp32' else ' whole'} | "
                                f"{_verdict(r['passed'])} |"),
    "steps": ("| row | model | recipe | batch | compile | ms unrouted | ms routed | ideal speedup | measured | efficiency | "
              "MFU unrouted | MFU routed | first steps s (graphs) |",
              lambda r: f"| {r['section']} | {r['backbone']}-{r['preset']}/2 ({r['tokens']} tokens, {r['channels']} ch) | {r['policy']} {r['route']} | "
                        f"{r['batch']} | {_mode(r)} | {_ranged(r, 'ms_unrouted', '.1f')} | {_ranged(r, 'ms_routed', '.1f')} | {r['ideal']:.2f}x | "
                        f"{r['measured']:.2f}x | {_ranged(r, 'efficiency', '.2f')} | {_ranged(r, 'mfu_unrouted', '.1%')} | "
                        f"{_ranged(r, 'mfu_routed', '.1%')} | {_f(r.get('first_s'), '.1f')} ({_f(r['graphs'], 'd')}) |"),
    "attention_checks": ("| check | recipe | shape | SDPA calls | shapes | flash only (torch) | what keeps flash out | result |",
                         lambda r: f"| {r['check']} | {r['recipe']} | {r['shape']} | {r['calls']} | {'; '.join(r['shapes'])} | "
                                   f"{'yes' if r['torch_flash_only'] else 'no (CPU)'} | {'; '.join(r['blockers']) or '-'} | "
                                   f"{_verdict(r['passed'])} |"),
    "kernel_speed": ("| kernel | precision | shape | Triton fwd ms | Triton fwd+bwd ms | first call s | PyTorch op fwd+bwd ms | speedup | "
                     "ideal MB fwd+bwd | achieved GB/s | of peak | roofline ms | goal | tuned configs (best of all, ms) |",
                     lambda r: f"| {r['kernel']} | {r['precision']} | {r['shape']} | {_ranged(r, 'ms_fwd', '.3f')} | "
                               f"{_ranged(r, 'ms_fwd_bwd', '.3f')} | {_f(r.get('first_s'), '.1f')} | "
                               f"{r['ms_torch_fwd_bwd']:.3f} | {r['speedup_vs_torch']:.1f}x | {r['ideal_bytes_fwd_bwd'] / 1e6:.1f} | "
                               f"{r['achieved_gbps']:.0f} | {_f(r['peak_fraction'], '.0%')} | {_f(r['roofline_ms'], '.3f')} | "
                               f"{_goal(r)} | {_tuned_cell(r.get('tuned', {}))} |"),
    "official": ("| model | route | batch | compile | official ms unrouted | ours ms unrouted | official ms routed | ours ms routed | "
                 "official saving (its FLOPs predict) | our saving (our FLOPs predict) | ours / official routed | decides the goal | "
                 "MFU ours unrouted | MFU ours routed | first steps s ours (graphs) | official first steps s (graphs) | official copy (sha256) |",
                 lambda r: f"| DiT-{r['preset']}/2 ({r['tokens']} tokens) | {r['route']} | {r['batch']} | {_mode(r)} | "
                           f"{r['ms_official_unrouted']:.1f} | {r['ms_ours_unrouted']:.1f} | "
                           f"{r['ms_official_routed']:.1f} | {r['ms_ours_routed']:.1f} | "
                           f"{_ranged(r, 'saving_official', '.0%')} ({r['ideal_saving_official']:.0%}) | "
                           f"{_ranged(r, 'saving_ours', '.0%')} ({r['ideal_saving_ours']:.0%}) | {_ranged(r, 'ratio_routed', '.3f')}x | "
                           f"{'yes' if r['fair'] else '**no**'} | {_ranged(r, 'mfu_unrouted', '.1%')} | {_ranged(r, 'mfu_routed', '.1%')} | "
                           f"{_f(r['first_s'], '.0f')} ({_f(r['graphs'], 'd')}) | {r['official_first_s']:.1f} ({_f(r.get('official_graphs'), 'd')}) | "
                           f"{r.get('official_sha256', '-')} |"),
    "scaling": (scaling.header(timed=True), lambda r: scaling.table_row(r, timed=True)),
    "trainer": ("| command | trainer images/s | bare step images/s | trainer / bare | first logged step s |",
                lambda r: f"| `{r['command']}` | {_ranged(r, 'trainer_images_per_s', '.0f')} | {_f(r['bare_images_per_s'], '.0f')} | "
                          f"{_ranged(r, 'ratio', '.2f')} | {_f(r.get('first_s'), '.0f')} |"),
}


HEADINGS = {"kernel_checks": "Kernels against their references", "family_checks": "Families on the device against the CPU",
            "attention_checks": "DiT's attention on the flash kernel",
            "kernel_speed": "Kernels at their reference shapes", "steps": "Training steps (train.bench.routing)",
            "official": "Side by side with CompVis/tread's DiT (train.bench.official)",
            "trainer": "python -m train against the bare step",
            "scaling": "Cost against tokens (train.bench.scaling)"}
# How to read each table, printed above it.
READING = {
    "kernel_checks": "Each Triton kernel through its entry point against the fp64 definition on the same inputs; an error is "
                     "max |got - want| / max |want| over the output or one gradient (train/bench/gpu_checks.py KERNEL_TOLERANCE).",
    "family_checks": "Each family, unrouted, with its zero-initialised layers redrawn, on the device against the CPU in fp32 on "
                     "the same weights; fp32 is checked tensor by tensor, bf16 autocast on the whole gradient vector "
                     "(train/bench/gpu_checks.py FAMILY_TOLERANCE).",
    "attention_checks": "One training forward and backward of DiT under bf16 autocast per recipe; every "
                        "scaled_dot_product_attention call must meet flash attention's conditions (fp16/bf16, head dim a multiple of 8 "
                        "up to 256, no mask, contiguous last dim); on CUDA SDPA is restricted to the flash kernel, so torch itself "
                        "refuses a call it cannot take (train/bench/gpu_checks.py attention_checks).",
    "kernel_speed": "Median of interleaved calls in each round; the median over the rounds and their range. The first call "
                    "holds Triton's compile and autotuning. Ideal bytes: every tensor read or written once, the roofline's lower bound; "
                    "achieved GB/s and the fraction of the card's peak are of those bytes over the forward+backward time.",
    "steps": "One EDM step with fused AdamW, unrouted and routed on the same weights, timed interleaved in rounds; each cell is "
             "the median over the rounds with their range in brackets; efficiency = measured speedup / FLOP-ideal speedup; "
             "MFU = counted FLOPs / time / the card's dense bf16 peak. First steps: one unrouted and one routed step before "
             "the timing, compilation included.",
    "official": "Both DiTs at the same size and route behind our EDM preconditioning, one EDM step with fused AdamW each, TF32 "
                "on, timed interleaved in rounds. Each side runs as its trainer runs it: the official blocks with their own "
                "@torch.compile, its block after a route in fp32, its own route draws; ours in the compile mode shown, with "
                "routing.fp32_after_route as the row says. Saving = 1 - routed / unrouted time of that side, beside what its own "
                "counted FLOPs predict. The ratio decides the goal only where the official side's routing works in this "
                "harness (it saves >= 20% where its FLOPs predict > 40%, and its efficiency is within 0.1 of ours). "
                "MFU = our counted FLOPs / our time / the card's dense bf16 peak.",
    "scaling": "Every family's training step, unrouted, with its TREAD recipe and with SPRINT, from 256 to 16,384 tokens at the "
               "S and B presets, the batch keeping 16,384 tokens per step (a flat line is a cost linear in tokens); bf16 "
               "autocast, eager, DiT's and DiffMoE's attention held to flash. ms: median of interleaved steps; MFU: counted "
               "FLOPs / time / the card's dense bf16 peak; peak memory: the first step's; \"does not fit\": the model or its "
               "first step ran out of memory. A dry run steps each recipe once at its tiny shape on the CPU: its times mean "
               "nothing. python -m train.bench.scaling plots the same rows.",
    "trainer": "python -m train's trainer (its config composed as the command composes it, then Trainer.fit, in the "
               "check's process) in images/s over its logged steps after the first logged one (compilation and warm-up), "
               "each span between two logged steps a round, against batch / the bare routed step's time at the same shape "
               "and compile mode; the ratio's range pairs the extremes of both. First logged step: seconds from the loop's "
               "start to it (compilation and its first log_every steps).",
}


def markdown(report: dict) -> str:
    env, sections = report["environment"], report["sections"]
    lines = [f"# GPU check: {env['device']}{' (dry run: tiny shapes on the CPU)' if report['dry_run'] else ''}", "",
             f"`{report['command']}`, {report['date']}", "",
             f"- torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}, Python {env['python']}, commit {env['commit']}",
             f"- bf16 autocast: {report['bf16']}; compile mode: {report['compile']}{' with regions' if report.get('compile_regions') else ''}"
             f"{' with CUDA graphs' if report['cuda_graphs'] else ''}; {report.get('rounds', 1)} rounds per speed row"
             f"{'; profiled' if report.get('profile') else ''}; budget {report['budget_s']:.0f} s, used {report['seconds']:.0f} s "
             f"(estimated {report.get('estimate_s', 0):.0f} s for these sections on one H100)", *_caches(report), "", "## Sections", ""]
    for s in sections:
        lines.append(f"- {s['title']}: **{s['status']}**" + (f" in {s['seconds']:.0f} s" if s["seconds"] is not None else "")
                     + (f"; {s['note']}" if s["note"] else ""))
    done = {s["name"] for s in sections}
    lines += [f"- {name}: **not reached** (the call ended before it; this report was written after the section before)"
              for name in report.get("asked", []) if name not in done]
    lines += _not_run(report)
    lines += ["", "## Goals" + (" (a dry run decides none)" if report["dry_run"] else ""), "",
              "Median and range over the row's rounds; met only when the whole range meets the goal, missed only when the whole "
              "range misses it, undecided otherwise.", "", "| goal | median | range | verdict | note |", "|---|---|---|---|---|"]
    for g in report["goals"]:
        shown = {"missed": "**missed**", "undecided": "*undecided*"}.get(g["verdict"], g["verdict"])
        rounds = f" ({g['n']} rounds)" if g.get("n", 0) > 1 else ""
        note = g.get("note") or ""
        if report["dry_run"] and g.get("rule", "not measured") != "not measured":
            note = "; ".join(x for x in (note, f"the rule reads {g['rule']} on the tiny shapes") if x)
        lines.append(f"| {g['goal']} | {g['measured'] or '-'} | {(g.get('range') or '-') + rounds} | {shown} | {note} |")
    for kind, heading in HEADINGS.items():
        records = [r for s in sections for r in _records(s) if _table_kind(s, r) == kind]
        if not records:
            continue
        header, fmt = TABLES[kind]
        good = [r for r in records if "error" not in r]
        lines += ["", f"## {heading}", "", READING[kind], ""]
        lines += [header, "|---" * (header.count("|") - 1) + "|", *(fmt(r) for r in good), ""] if good else []
        # A row that could not be measured: what it was, and the error in one line.
        lines += [f"- {' '.join(str(v) for k, v in r.items() if k not in ('error', 'passed', 'section'))}: **{r['error']}**"
                  for r in records if "error" in r]
        lines += [f"- {r['section']}: {r['note']}" for r in good if r.get("note")]
        lines += _launches(good) if kind == "kernel_speed" else []
        lines += _profiles(good)
        if lines[-1] == "":
            lines.pop()
    return "\n".join(lines) + "\n"


def _launches(rows: list[dict]) -> list[str]:
    """Each kernel row's profiled forward+backward: its costliest launches, one line each."""
    lines = []
    for r in (r for r in rows if r.get("launches")):
        lines += [f"Launches of one {r['kernel']} {r['precision']} forward+backward (torch.profiler, costliest first):", ""]
        lines += [f"- {x['us']:.0f} us in {x['calls']} call(s): `{x['name']}`" for x in r["launches"]] + [""]
    return lines


def _profiles(rows: list[dict]) -> list[str]:
    """Each profiled row's steps (--profile): the shares of each kind of work and the costliest launches."""
    lines = []
    for r in (r for r in rows if r.get("profile")):
        name = r.get("section", "")
        for step, prof in r["profile"].items():
            lines += profile_lines(f"{name}, one {step} step (torch.profiler)", prof)
    return lines


def _caches(report: dict) -> list[str]:
    """Which Inductor and Triton caches the compiles used: fresh ones make every first step a cold compile."""
    caches = report.get("caches") or {}
    if not caches:
        return []
    return ["- compile caches: " + ", ".join(f"{name} {'fresh for this call' if where == 'fresh' else where}"
                                             for name, where in caches.items())]


def _not_run(report: dict) -> list[str]:
    """The sections this run left out (opt-in, or not asked for) and those skipped for the budget, with the call
    that runs the skipped ones."""
    lines = []
    second = [x for x in report.get("not_run", []) if x.get("second_call")]
    if second:
        lines += ["", f"The second call, for the goals this set leaves out (about {sum(x['estimate_s'] for x in second):.0f} s): "
                  f"`python -m train.bench.gpu --sections {' '.join(x['name'] for x in second)}` ("
                  + "; ".join(x["title"] for x in second) + ")."]
    optional = [x for x in report.get("not_run", []) if not x.get("second_call")]
    if optional:
        lines += ["", "Not in this run (name them with --sections): "
                  + "; ".join(f"{x['name']} ({x['title']}, about {x['estimate_s']:.0f} s)" for x in optional)]
    skipped = [s["name"] for s in report["sections"] if s["status"] in ("skipped", "stopped")]
    if skipped:
        lines += ["", f"Skipped or stopped for the budget: `python -m train.bench.gpu --sections {' '.join(skipped)}` runs them."]
    return lines
