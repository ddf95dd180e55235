"""Sampling rules compared at their cost: routed inference, routing guidance and CFG, for one or more runs.

    python -m train.bench.sampling runs/edm runs/flow --gammas 0 0.25 0.5 0.75 --cfg 1.5 2 \\
        --rg 1.5,0,0.5 2,0,0.5 2,0.25,0.75 --out docs/sampling

For every run (a routed model; several runs, e.g. EDM and flow trained for the same budget, side by side)
and every rule, samples `--per-class` images per class with the same seed and scores them with the bench's
classifier (train/metrics/classifier.py: classifier-FD against real images and class accuracy; the test
split when the dataset has one). Cost is the FLOPs of generating one image with that rule (every network
evaluation, both guidance branches and the forced routing included), counted by torch.utils.flop_counter.
Writes table.md and quality_vs_flops.png under --out.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from edm import generate, with_routing_guidance  # noqa: E402
from routing import ConfigError  # noqa: E402
from routing.router import count_flops  # noqa: E402
from train.build import objective_name  # noqa: E402
from train.checkpoint import load_run  # noqa: E402
from train.cli import friendly_errors  # noqa: E402
from train.data import build_dataset  # noqa: E402
from train.grid import grid_labels  # noqa: E402
from train.metrics.classifier import ClassifierConfig, features, load_or_train, sample_scores  # noqa: E402


@dataclass
class Rule:
    """One way to sample: CFG scale, forced routing ratio, routing guidance (scale, gamma_1, gamma_2)."""

    name: str
    kind: str  # plain | routed | cfg | rg
    cfg: float = 1.0
    route_ratio: float = 0.0
    rg: tuple[float, float, float] | None = None


def rules(gammas: list[float], cfg_scales: list[float], rg_specs: list[str]) -> list[Rule]:
    out = [Rule("plain", "plain")]
    out += [Rule(f"routed {g:g}", "routed", route_ratio=g) for g in gammas if g > 0]
    out += [Rule(f"CFG {w:g}", "cfg", cfg=w) for w in cfg_scales]
    for spec in rg_specs:
        try:
            w, g1, g2 = (float(v) for v in spec.split(","))
        except ValueError:
            raise ConfigError(f"--rg {spec!r} must be scale,gamma_1,gamma_2 (e.g. 2,0,0.5).") from None
        if not 0 <= g1 <= g2 < 1:
            raise ConfigError(f"--rg {spec!r} needs 0 <= gamma_1 <= gamma_2 < 1.")
        out.append(Rule(f"RG {w:g} ({g1:g}/{g2:g})", "rg", rg=(w, g1, g2)))
    return out


def sample(loaded, rule: Rule, labels: torch.Tensor, steps: int, seed: int, device) -> torch.Tensor:
    net, ds, router = loaded.net, loaded.dataset, loaded.net.model.router
    if rule.rg is not None:
        w, g1, g2 = rule.rg
        net = with_routing_guidance(net, router, w, g1 or None, g2, null_label=ds.num_classes)
    return generate(net, labels, shape=ds.shape, steps=steps, guidance=rule.cfg, seed=seed, device=device,
                    null_label=ds.num_classes, objective=loaded.objective, router=router, route_ratio=rule.route_ratio)


def reference(loaded):
    """Real images to score against: the test split when the dataset has one, else its own images."""
    data = loaded.cfg.data.copy()
    if "split" in data:
        with open_dict(data):
            data.split = "test"
    return build_dataset(data, loaded.cfg.edm.sigma_data), data.get("split", "training images")


def evaluate(run: str, rule_list: list[Rule], args) -> list[dict]:
    loaded = load_run(run, args.device)
    ds = loaded.dataset
    classifier, meta = load_or_train(ds, ClassifierConfig(), args.cache_dir)
    real, where = reference(loaded)
    count = min(len(real), args.num_real)
    real_images, _ = real.get(torch.arange(count))
    real_features = features(classifier, real_images)
    labels = grid_labels(ds.num_classes, args.per_class)
    rows = []
    for rule in rule_list:
        flops = count_flops(lambda: sample(loaded, rule, labels[:1], args.steps, args.seed, args.device))
        scores = sample_scores(classifier, sample(loaded, rule, labels, args.steps, args.seed, args.device), labels, real_features)
        rows.append({"run": run, "objective": objective_name(loaded.cfg), "rule": rule.name, "kind": rule.kind,
                     "gflops_per_image": flops / 1e9, **scores, "reference": f"{count} {where}",
                     "classifier_accuracy": meta["heldout_accuracy"]})
        print(f"{run} | {rule.name:18s} | {flops / 1e9:8.3f} GFLOPs/image | classifier-FD {scores['classifier_fd']:.3f} | "
              f"class accuracy {scores['class_accuracy']:.1%}", flush=True)
    return rows


def write(rows: list[dict], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| run | objective | rule | GFLOPs / image | classifier-FD | class accuracy |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['objective']} | {r['rule']} | {r['gflops_per_image']:.3f} | {r['classifier_fd']:.3f} | "
              f"{r['class_accuracy']:.1%} |" for r in rows]
    lines += ["", f"Command: `{command}`. Reference: {rows[0]['reference']}; classifier held-out accuracy "
              f"{rows[0]['classifier_accuracy']:.1%}."]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    markers = {"plain": "o", "routed": "v", "cfg": "s", "rg": "*"}
    for run in dict.fromkeys(r["run"] for r in rows):
        for kind, marker in markers.items():
            mine = [r for r in rows if r["run"] == run and r["kind"] == kind]
            for ax, key in zip(axes, ("classifier_fd", "class_accuracy")):
                ax.scatter([r["gflops_per_image"] for r in mine], [r[key] for r in mine], marker=marker,
                           label=f"{Path(run).name}: {kind}" if mine else None)
    axes[0].set(xlabel="GFLOPs per image", ylabel="classifier-FD (lower is better)")
    axes[1].set(xlabel="GFLOPs per image", ylabel="class accuracy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "quality_vs_flops.png", dpi=120)
    plt.close(fig)


@friendly_errors
def main(argv: list[str] | None = None) -> list[dict]:
    import sys

    parser = argparse.ArgumentParser(prog="python -m train.bench.sampling", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run or checkpoint folders (trained with routing)")
    parser.add_argument("--gammas", type=float, nargs="*", default=[0.25, 0.5, 0.75], help="routed-inference ratios")
    parser.add_argument("--cfg", type=float, nargs="*", default=[1.5, 2.0], help="classifier-free guidance scales")
    parser.add_argument("--rg", nargs="*", default=["1.5,0,0.5", "2,0,0.5", "2,0.25,0.75"], help="routing guidance: scale,gamma_1,gamma_2")
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--per-class", type=int, default=20)
    parser.add_argument("--num-real", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default="~/.cache/tread-zoo")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("bench_runs/sampling"))
    args = parser.parse_args(argv)
    if args.steps < 1 or args.per_class < 2 or args.num_real < 2:
        raise ConfigError("--steps must be >= 1, and --per-class and --num-real >= 2 (a Fréchet distance needs spread).")
    rule_list = rules(args.gammas, args.cfg, args.rg)
    rows = [row for run in args.runs for row in evaluate(run, rule_list, args)]
    write(rows, args.out, " ".join(["python -m train.bench.sampling", *(argv if argv is not None else sys.argv[1:])]))
    print(f"wrote {args.out}/table.md and quality_vs_flops.png")
    return rows


if __name__ == "__main__":
    main()
