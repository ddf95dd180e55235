"""Sampling rules compared at their cost: routed inference, routing guidance, path-drop guidance and CFG, over
several training seeds.

    python -m train.bench.sampling bench_runs/fashion/runs/dit-random-s{0,1,2} \\
        bench_runs/fashion-flow/runs/dit-random-s{0,1,2} --gammas 0.25 0.5 0.75 --cfg 1.5 2 \\
        --rg 1.5,0,0.5 2,0,0.5 2,0.25,0.75 2,0,0.5,uncond --out docs/sampling

Every run (a routed model) is sampled with every rule: `--per-class` images per class, the same sampling seed,
scored by the bench's classifier for the dataset (train/metrics/classifier.py, the one `python -m train.bench`
cached; classifier-FD against the test split when the dataset has one, and class accuracy). Runs are grouped by
objective, backbone and routing (the runs of a group are training seeds of one recipe): each group reports the
mean and 95% t-interval over its runs, and every rule's paired difference from plain sampling of the same run.
With two groups (e.g. EDM and flow trained for the same budget) it also reports their Welch difference per rule.

    python -m train.bench.sampling docs/.../dit-sprint-s{0,1,2} --cfg 1.5 2 3 --pdg 1.5 2 3 --rg --gammas --match-flops

Cost per image: the FLOPs of generating one image with the rule (every network evaluation, both guidance
branches and forced routing included; routing.count_flops) and the number of network evaluations. With
`--match-flops` every rule gets the sampler steps that spend CFG's FLOPs per image at `--steps` (train/bench/matched.py),
and the table adds each guidance rule at its best swept scale, paired against the best CFG.
Writes table.md, table.json and quality_vs_flops.png under --out. Each (run, rule) measurement is saved under
--out/rows/ with the settings it was made under, so a killed study resumes, and runs sampled by separate calls
(processes) are combined by one more call over all of them.

A source may also be an earlier study's table.json: its rows join this study's as they are, so training seeds whose
checkpoints are gone still pool with new ones (every source must share --steps, --per-class, --seed, the reference and
the classifier; a rule swept on some runs only does not compete for a group's best scale):

    python -m train.bench.sampling old-study/table.json bench_runs/fashion/runs/dit-random-s1 --cfg 2 --rg 8,0,0.5 ...
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from edm import generate, with_path_drop_guidance, with_routing_guidance  # noqa: E402
from routing import ConfigError, count_flops  # noqa: E402
from train.bench import matched  # noqa: E402
from train.bench.stats import summary, verdict, welch_difference  # noqa: E402
from train.bench.store import reuse_or_compute, write_json_atomic  # noqa: E402
from train.build import objective_name  # noqa: E402
from train.checkpoint import load_run  # noqa: E402
from train.cli import ArgumentParser, bounded, device as device_type, existing, friendly_errors, output_folder  # noqa: E402
from train.data import build_dataset  # noqa: E402
from train.grid import grid_labels  # noqa: E402
from train.metrics.classifier import features, load_or_train, sample_scores  # noqa: E402

SCORES = {"classifier_fd": True, "class_accuracy": False}  # score: lower is better
SAMPLING = ("steps", "per_class", "seed")  # the settings every pooled source must share
ROW_KEYS = {"run", "group", "seed", "step", "rule", "kind", "gflops_per_image", "evaluations", "reference", "classifier_accuracy",
            *SCORES}  # what a row of a study's table.json holds (evaluate)


@dataclass
class Rule:
    """One way to sample: CFG scale, forced routing ratio, routing guidance (scale, gamma_1, gamma_2, unconditional),
    path-drop guidance scale, and its sampler steps (None: --steps)."""

    name: str
    kind: str  # plain | routed | cfg | rg | pdg
    cfg: float = 1.0
    route_ratio: float = 0.0
    rg: tuple[float, float, float] | None = None
    unconditional: bool = False  # routing guidance as released (both branches get the null label)
    pdg: float | None = None  # SPRINT's path-drop guidance w
    steps: int | None = None


def rules(gammas: list[float], cfg_scales: list[float], rg_specs: list[str], pdg_scales: list[float] = ()) -> list[Rule]:
    out = [Rule("plain", "plain")]
    out += [Rule(f"routed {g:g}", "routed", route_ratio=g) for g in gammas if g > 0]
    out += [Rule(f"CFG {w:g}", "cfg", cfg=w) for w in cfg_scales]
    out += [Rule(f"PDG {w:g}", "pdg", pdg=w) for w in pdg_scales]
    for spec in rg_specs:
        parts = spec.split(",")
        unconditional = parts[-1] == "uncond"
        try:
            w, g1, g2 = (float(v) for v in parts[: 3 if unconditional else None])
        except ValueError:
            raise ConfigError(f"--rg {spec!r} must be scale,gamma_1,gamma_2[,uncond] (e.g. 2,0,0.5).") from None
        if not 0 <= g1 <= g2 < 1:
            raise ConfigError(f"--rg {spec!r} needs 0 <= gamma_1 <= gamma_2 < 1.")
        label = f"RG {w:g} ({g1:g}/{g2:g}{', uncond' if unconditional else ''})"
        out.append(Rule(label, "rg", rg=(w, g1, g2), unconditional=unconditional))
    return out


def sample(loaded, rule: Rule, labels: torch.Tensor, steps: int, seed: int, device, progress: bool = False) -> torch.Tensor:
    net, ds, router = loaded.net, loaded.dataset, loaded.net.model.router
    if rule.rg is not None:
        w, g1, g2 = rule.rg
        net = with_routing_guidance(net, router, w, g1 or None, g2, unconditional=rule.unconditional, null_label=ds.num_classes)
    if rule.pdg is not None:
        net = with_path_drop_guidance(net, router, rule.pdg, ds.num_classes)
    return generate(net, labels, shape=ds.shape, steps=rule.steps or steps, guidance=rule.cfg, seed=seed, device=device,
                    null_label=ds.num_classes, objective=loaded.objective, router=router, route_ratio=rule.route_ratio,
                    progress=progress)


def evaluations_per_image(loaded, rule: Rule, steps: int, device) -> int:
    """Network evaluations that generating one image with `rule` takes (a batched CFG call counts its two halves)."""
    count = []
    hook = loaded.net.model.register_forward_pre_hook(lambda module, args: count.append(args[0].shape[0]))
    try:
        sample(loaded, rule, torch.zeros(1, dtype=torch.long), steps, 0, device)
    finally:
        hook.remove()
    return sum(count)


def reference(loaded):
    """Real images to score against: the test split when the dataset has one, else its own images."""
    data = loaded.cfg.data.copy()
    if "split" in data:
        with open_dict(data):
            data.split = "test"
    return build_dataset(data, loaded.cfg.edm.sigma_data), data.get("split", "training")


def group_of(cfg) -> str:
    """The recipe a run belongs to: its objective, backbone and routing (the seed is what varies inside a group)."""
    recipe = "sprint" if any(r.get("mode") == "sprint" for r in cfg.routing.routes) else cfg.routing.policy
    return f"{objective_name(cfg)} {cfg.backbone.name}-{recipe}"


def at_matched_flops(loaded, rule_list: list[Rule], labels, args) -> list[Rule]:
    """Every rule with the sampler steps that spend CFG's FLOPs per image at --steps (train/bench/matched.py)."""
    def flops_at(rule: Rule, steps: int) -> int:
        flops = count_flops(lambda: sample(loaded, replace(rule, steps=steps), labels[:1], steps, args.seed, args.device))
        # Each count samples one image under the FLOP counter (minutes on a slow CPU backbone): say where the search is.
        print(f"matching FLOPs: {rule.name} at {steps} sampler steps: {flops / 1e9:.3f} GFLOPs/image", flush=True)
        return flops

    budget = flops_at(Rule("CFG", "cfg", cfg=2.0), args.steps)
    return [replace(rule, steps=matched.matched_steps(functools.cache(functools.partial(flops_at, rule)), budget, args.steps))
            for rule in rule_list]


def evaluate(run: str, rule_list: list[Rule], args) -> list[dict]:
    """One row per rule for one run; each row is saved under --out with its settings and reused by a later call."""
    loaded = load_run(run, args.device)
    ds = loaded.dataset
    real, where = reference(loaded)
    classifier, meta = load_or_train(ds, None, args.cache_dir, real if where == "test" else None)
    count = min(len(real), args.num_real)
    real_features = features(classifier, real.get(torch.randperm(len(real), generator=torch.Generator().manual_seed(0))[:count])[0])
    labels = grid_labels(ds.num_classes, args.per_class)
    if args.match_flops:
        rule_list = at_matched_flops(loaded, rule_list, labels, args)
    # Relative to the working directory when under it, so rows committed from one clone are reused in another;
    # abspath keeps a symlinked runs folder (bench_runs -> a bigger disk) under it, where resolve() would leave it.
    checkpoint = Path(os.path.abspath(loaded.checkpoint))
    checkpoint = checkpoint.relative_to(Path.cwd()) if checkpoint.is_relative_to(Path.cwd()) else checkpoint
    rows = []
    for rule in rule_list:
        def measure(rule=rule) -> dict:
            flops = count_flops(lambda: sample(loaded, rule, labels[:1], args.steps, args.seed, args.device))
            scores = sample_scores(classifier, sample(loaded, rule, labels, args.steps, args.seed, args.device, progress=True),
                                   labels, real_features)
            print(f"{run} | {rule.name:24s} | {flops / 1e9:8.3f} GFLOPs/image | classifier-FD {scores['classifier_fd']:.3f} | "
                  f"class accuracy {scores['class_accuracy']:.1%}", flush=True)
            return {"gflops_per_image": flops / 1e9, "evaluations": evaluations_per_image(loaded, rule, args.steps, args.device),
                    **scores}
        settings = {"checkpoint": str(checkpoint), "step": loaded.step, "rule": asdict(rule),
                    "steps": args.steps, "per_class": args.per_class, "num_real": count, "seed": args.seed,
                    "classifier": meta["config"], "device": args.device}
        name = f"{checkpoint}-{rule.name}{f'-{rule.steps}steps' if rule.steps else ''}".replace("/", "_").replace(" ", "_")
        measured = reuse_or_compute(args.out / "rows" / f"{name}.json", settings, measure, f"{run}: {rule.name}")
        rows.append({"run": run, "group": group_of(loaded.cfg), "seed": loaded.cfg.seed, "step": loaded.step, "rule": rule.name,
                     "kind": rule.kind, "sampler_steps": rule.steps or args.steps,
                     **{k: measured[k] for k in ("gflops_per_image", "evaluations", *SCORES)},
                     "reference": f"{count} {where} images", "classifier_accuracy": meta["heldout_accuracy"]})
    return rows


def studied(path: Path) -> dict:
    """An earlier study's table.json: its sampling settings and rows (its runs' checkpoints need not exist)."""
    try:
        table = json.loads(path.read_text())
        settings, rows = {key: table[key] for key in SAMPLING}, table["rows"]
        # Valid JSON of another shape (a list, rows that are not this study's rows) is refused as well, not read.
        if not (all(isinstance(v, int) for v in settings.values()) and isinstance(rows, list)
                and all(isinstance(r, dict) and ROW_KEYS <= r.keys() for r in rows)):
            raise TypeError
        return {"settings": settings, "rows": rows}
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"{path} is not a table.json written by `python -m train.bench.sampling`; "
                          "give run folders or such a file.") from None


def pooled(sources: list[str], rule_list: list[Rule], args) -> list[dict]:
    """Every source's rows: run folders are sampled (or their saved rows reused), earlier studies' tables are read.
    The sampling settings are checked before any sampling; the reference and classifier once the rows exist (the
    sampled rows are saved under --out, so a refusal there loses no work)."""
    tables = {source: studied(Path(source)) for source in sources if source.endswith(".json")}
    settings = {source: t["settings"] for source, t in tables.items()}
    if len(tables) < len(sources):
        settings["this call"] = {key: getattr(args, key) for key in SAMPLING}
    for key in SAMPLING:
        if len({s[key] for s in settings.values()}) > 1:
            seen = ", ".join(f"{source}: {s[key]}" for source, s in settings.items())
            raise ConfigError(f"--{key.replace('_', '-')} differs between the sources ({seen}); pool only studies "
                              "sampled with the same settings.")
    vars(args).update(next(iter(settings.values())))  # a table-only call reports the tables' settings
    rows = [row for source in sources
            for row in (tables[source]["rows"] if source in tables else evaluate(source, rule_list, args))]
    for key, what in (("reference", "--num-real (the reference images)"), ("classifier_accuracy", "--cache-dir (the classifier)")):
        if len({r[key] for r in rows}) > 1:
            raise ConfigError(f"the sources differ in {what}; pool only studies scored the same way.")
    measured = {}
    for r in rows:
        key = (r["group"], r["seed"], r["step"], r["rule"])
        if key in measured and any(measured[key][score] != r[score] for score in SCORES):
            raise ConfigError(f"{r['group']} seed {r['seed']}, {r['rule']}: two sources measured it differently; "
                              "give each measurement once.")
        measured.setdefault(key, r)  # the same measurement reached twice (a table and its run) counts once
    return list(measured.values())


def aggregate(rows: list[dict]) -> list[dict]:
    """Per (group, rule): mean and 95% interval over runs, and the paired difference from plain sampling."""
    out = []
    for group in dict.fromkeys(r["group"] for r in rows):
        mine = [r for r in rows if r["group"] == group]
        plain = {r["run"]: r for r in mine if r["kind"] == "plain"}
        for rule in dict.fromkeys(r["rule"] for r in mine):
            runs = [r for r in mine if r["rule"] == rule]
            agg = {"group": group, "rule": rule, "kind": runs[0]["kind"], "runs": len(runs), "steps_trained": runs[0]["step"],
                   "sampler_steps": runs[0].get("sampler_steps"),
                   "gflops_per_image": runs[0]["gflops_per_image"], "evaluations": runs[0]["evaluations"]}
            for key, lower in SCORES.items():
                s = summary([r[key] for r in runs])
                agg[key], agg[f"{key}_ci95"] = s["mean"], s["ci95"]
                if rule != "plain" and all(r["run"] in plain for r in runs):
                    # Paired: the same run and sampling seed, so the run-to-run spread cancels.
                    d = summary([r[key] - plain[r["run"]][key] for r in runs])
                    agg[f"{key}_vs_plain"], agg[f"{key}_vs_plain_ci95"] = d["mean"], d["ci95"]
                    if d["ci95"] is not None:
                        agg[f"{key}_vs_plain_verdict"] = verdict({"low": d["mean"] - d["ci95"], "high": d["mean"] + d["ci95"]}, lower)
            out.append(agg)
    return out


def between_groups(rows: list[dict]) -> list[dict]:
    """With exactly two groups: second minus first per rule, Welch 95% interval and verdict (lower FD is better)."""
    groups = list(dict.fromkeys(r["group"] for r in rows))
    if len(groups) != 2:
        return []
    out = []
    for rule in dict.fromkeys(r["rule"] for r in rows):
        a, b = ([r for r in rows if r["group"] == g and r["rule"] == rule] for g in groups)
        if not a or not b:
            continue
        line = {"rule": rule, "first": groups[0], "second": groups[1]}
        for key, lower in SCORES.items():
            d = welch_difference([r[key] for r in b], [r[key] for r in a])
            line[key] = d | {"verdict": verdict(d, lower)}
        out.append(line)
    return out


def _pm(value, half, fmt: str) -> str:
    return fmt.format(value) + ("" if half is None else f" ± {fmt.format(half)}")


def _diff(mean, half, verdict_, fmt: str) -> str:
    """A signed paired difference, ± its unsigned half-width, and the verdict."""
    if mean is None:
        return ""
    return fmt.format(mean) + ("" if half is None else f" ± {fmt.replace('+', '').format(half)} {verdict_}")


def markdown(agg: list[dict], cross: list[dict], command: str, rows: list[dict]) -> str:
    lines = ["| group | rule | sampler steps | evaluations / image | GFLOPs / image | classifier-FD | class accuracy | "
             "FD vs plain (paired) | accuracy vs plain (paired) |", "|---|---|---|---|---|---|---|---|---|"]
    for a in agg:
        lines.append(
            f"| {a['group']} | {a['rule']} | {a.get('sampler_steps', '')} | {a['evaluations']} | {a['gflops_per_image']:.3f} | "
            f"{_pm(a['classifier_fd'], a['classifier_fd_ci95'], '{:.2f}')} | "
            f"{_pm(a['class_accuracy'], a['class_accuracy_ci95'], '{:.1%}')} | "
            f"{_diff(a.get('classifier_fd_vs_plain'), a.get('classifier_fd_vs_plain_ci95'), a.get('classifier_fd_vs_plain_verdict'), '{:+.2f}')} | "
            f"{_diff(a.get('class_accuracy_vs_plain'), a.get('class_accuracy_vs_plain_ci95'), a.get('class_accuracy_vs_plain_verdict'), '{:+.1%}')} |")
    r = rows[0]
    runs = {g: sorted({x["seed"] for x in rows if x["group"] == g}) for g in dict.fromkeys(x["group"] for x in rows)}
    lines += ["", f"Command: `{command}`. Runs per group (training seeds): "
              + "; ".join(f"{g}: seeds {s}" for g, s in runs.items())
              + f". Reference: {r['reference']}; classifier held-out accuracy {r['classifier_accuracy']:.1%}. Values: mean ± the "
              "half-width of the 95% t-interval over runs; vs plain: the paired difference (same run, same sampling seed) "
              "with its 95% t-interval and verdict (wins / loses when it excludes 0, else ties)."]
    if cross:
        lines += ["", f"{cross[0]['second']} minus {cross[0]['first']}, per rule (95% Welch interval):", "",
                  "| rule | classifier-FD | class accuracy |", "|---|---|---|"]
        for c in cross:
            cells = []
            for key, fmt in (("classifier_fd", "{:+.2f}"), ("class_accuracy", "{:+.1%}")):
                d = c[key]
                span = "" if d["low"] is None else f" [{fmt.format(d['low'])}, {fmt.format(d['high'])}]"
                cells.append(f"{fmt.format(d['diff'])}{span} {d['verdict']}")
            lines.append(f"| {c['rule']} | {' | '.join(cells)} |")
    best = matched.best_per_kind(agg)
    if best:
        lines += matched.markdown(best, matched.against_cfg(rows, best))
    return "\n".join(lines) + "\n"


def plot(agg: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    markers = {"plain": "o", "routed": "v", "cfg": "s", "rg": "*", "pdg": "D"}
    for gi, group in enumerate(dict.fromkeys(a["group"] for a in agg)):
        colour = f"C{gi}"
        for kind, marker in markers.items():
            mine = [a for a in agg if a["group"] == group and a["kind"] == kind]
            if not mine:
                continue
            for ax, key in zip(axes, SCORES):
                ax.errorbar([a["gflops_per_image"] for a in mine], [a[key] for a in mine],
                            yerr=[a[f"{key}_ci95"] or 0 for a in mine], fmt=marker, color=colour, capsize=3,
                            label=f"{group}: {kind}")
        routed = sorted((a for a in agg if a["group"] == group and a["kind"] in ("plain", "routed")), key=lambda a: a["gflops_per_image"])
        for ax, key in zip(axes, SCORES):
            ax.plot([a["gflops_per_image"] for a in routed], [a[key] for a in routed], color=colour, lw=0.8, alpha=0.6)
    axes[0].set(xlabel="GFLOPs per image", ylabel="classifier-FD (lower is better)", title="FD against sampling cost")
    axes[1].set(xlabel="GFLOPs per image", ylabel="class accuracy", title="class accuracy against sampling cost")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m train.bench.sampling", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=existing("run"), help="run or checkpoint folders (trained with routing), or earlier studies' "
                        "table.json (their checkpoints may be gone); a group's runs are its seeds")
    parser.add_argument("--gammas", type=bounded(float, 0, 0.99), nargs="*", default=[0.25, 0.5, 0.75], help="routed-inference ratios")
    parser.add_argument("--cfg", type=bounded(float, 0, 100), nargs="*", default=[1.5, 2.0], help="classifier-free guidance scales")
    parser.add_argument("--rg", nargs="*", default=["1.5,0,0.5", "2,0,0.5", "2,0.25,0.75"],
                        help="routing guidance: scale,gamma_1,gamma_2 (append ,uncond for the released unconditional rule)")
    parser.add_argument("--pdg", type=bounded(float, 0, 100), nargs="*", default=[],
                        help="SPRINT's path-drop guidance scales (SPRINT models only)")
    parser.add_argument("--steps", type=bounded(int, 1), default=18, help="sampler steps")
    parser.add_argument("--match-flops", action="store_true",
                        help="every rule gets the sampler steps that spend CFG's FLOPs per image at --steps")
    parser.add_argument("--per-class", type=bounded(int, 2), default=20)
    parser.add_argument("--num-real", type=bounded(int, 2), default=1000, help="real images of the FD reference")
    parser.add_argument("--seed", type=bounded(int, 0), default=0, help="sampling seed (the same for every run and rule)")
    parser.add_argument("--cache-dir", type=output_folder, default="~/.cache/tread-zoo", help="where the bench cached its classifier")
    parser.add_argument("--device", type=device_type, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=bounded(int, 1), help="torch CPU threads")
    parser.add_argument("--out", type=output_folder, default=Path("bench_runs/sampling"))
    return parser.parse_args(argv)


@friendly_errors
def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the store's "reused ..." lines
    if args.threads:
        torch.set_num_threads(args.threads)
    rule_list = rules(args.gammas, args.cfg, args.rg, args.pdg)
    command = " ".join(["python -m train.bench.sampling", *(argv if argv is not None else sys.argv[1:])])
    args.out.mkdir(parents=True, exist_ok=True)
    rows = pooled(args.runs, rule_list, args)
    agg, cross = aggregate(rows), between_groups(rows)
    (args.out / "table.md").write_text(markdown(agg, cross, command, rows))
    write_json_atomic(args.out / "table.json", {"command": command, "rows": rows, "aggregate": agg, "between_groups": cross,
                                                "steps": args.steps, "per_class": args.per_class, "seed": args.seed})
    plot(agg, args.out / "quality_vs_flops.png")
    print(f"wrote {args.out}/table.md, table.json and quality_vs_flops.png")
    return rows


if __name__ == "__main__":
    main()
