"""DiffMoE's compute dynamics: activated experts per token against the sampling step and the class.

    python -m train.bench.moe runs/X --steps 18 --per-class 8 --out docs/figures/diffmoe_dynamics.png
    python -m train.bench.moe runs/X --moe-target 1.0          # a fixed average capacity instead of the learned thresholds

Samples one grid row per class from a run's EMA weights (global_pool MoE, eval mode: dynamic capacity)
and records, after every network evaluation, how many experts each token activated (mean over MoE
layers and tokens). Writes a PNG with two panels (per class against the evaluation index, from noise to
data; and the per-class average with the overall mean) and prints the numbers.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from backbones.diffmoe import capacity_stats, moe_layers, set_inference_capacity  # noqa: E402
from edm import generate  # noqa: E402
from routing import ConfigError  # noqa: E402
from train.checkpoint import load_run  # noqa: E402
from train.cli import ArgumentParser, bounded, device as device_type, existing, friendly_errors, writable_file  # noqa: E402
from train.grid import grid_labels  # noqa: E402


class LoadRecorder(nn.Module):
    """Calls the network and keeps the activated experts per token of every sample, per evaluation."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net, self.loads = net, []  # one (B,) tensor per network evaluation

    def forward(self, x, t, class_labels=None):
        out = self.net(x, t, class_labels)
        self.loads.append(capacity_stats(self.net)["per_sample"].float().cpu())
        return out


def dynamics(net, labels: torch.Tensor, dataset, objective, steps: int, seed: int, device) -> torch.Tensor:
    """Activated experts per token, (evaluations, samples), while sampling `labels` (guidance off)."""
    recorder = LoadRecorder(net)
    generate(recorder, labels, shape=dataset.shape, steps=steps, guidance=1.0, seed=seed, device=device,
             objective=objective, router=net.model.router)
    return torch.stack(recorder.loads)  # E x (B,) -> (E, B)


def plot(loads: torch.Tensor, labels: torch.Tensor, num_classes: int, out: Path, title: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    evaluations = torch.arange(loads.shape[0])
    per_class = torch.stack([loads[:, labels == c].mean(1) for c in range(num_classes)], 1)  # (E, classes)
    for c in range(num_classes):
        left.plot(evaluations, per_class[:, c], lw=1, label=f"class {c}")
    left.plot(evaluations, loads.mean(1), "k--", lw=2, label="all")
    left.set(xlabel="network evaluation (noise -> data)", ylabel="activated experts per token", title="against the sampling step")
    left.legend(fontsize=7, ncol=2)
    right.bar(range(num_classes), per_class.mean(0))
    right.axhline(loads.mean().item(), color="k", ls="--", label=f"mean {loads.mean().item():.2f}")
    right.set(xlabel="class", ylabel="activated experts per token", title="per class (all steps)")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


@friendly_errors
def main(argv: list[str] | None = None) -> torch.Tensor:
    parser = ArgumentParser(prog="python -m train.bench.moe", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=existing("checkpoint"), help="run folder or checkpoint folder of a diffmoe run")
    parser.add_argument("--steps", type=bounded(int, 1, example="--steps 18"), default=18, help="sampler steps")
    parser.add_argument("--per-class", type=bounded(int, 1, example="--per-class 8"), default=8)
    parser.add_argument("--seed", type=bounded(int, 0, example="--seed 0"), default=0)
    parser.add_argument("--moe-threshold", type=bounded(float, 0, 1, example="--moe-threshold 0.5"), help="one capacity threshold for every expert")
    parser.add_argument("--moe-target", type=bounded(float, 0.01, example="--moe-target 1.0"), help="average activated experts per token")
    parser.add_argument("--device", type=device_type, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=writable_file, help="PNG (default: <checkpoint>/moe_dynamics.png)")
    args = parser.parse_args(argv)
    if args.moe_threshold is not None and args.moe_target is not None:
        parser.error("give --moe-threshold or --moe-target, not both")
    loaded = load_run(args.checkpoint, args.device)
    net, ds = loaded.net, loaded.dataset
    if not any(m.mode == "global_pool" for m in moe_layers(net)):
        raise ConfigError(f"'{loaded.checkpoint}' has no global_pool MoE layers; train with backbone=diffmoe "
                          "(backbone.kwargs.moe_mode=global_pool) to see dynamic capacity.")
    set_inference_capacity(net, threshold=args.moe_threshold, target=args.moe_target)
    labels = grid_labels(ds.num_classes, args.per_class)
    loads = dynamics(net, labels, ds, loaded.objective, args.steps, args.seed, args.device)
    out = args.out or loaded.checkpoint / "moe_dynamics.png"
    control = "learned thresholds" if args.moe_threshold is None and args.moe_target is None else \
        f"threshold {args.moe_threshold}" if args.moe_threshold is not None else f"target {args.moe_target}"
    plot(loads, labels, ds.num_classes, out, f"DiffMoE compute dynamics ({loaded.cfg.backbone.preset}, step {loaded.step}, {control})")
    first, last = loads[: max(1, len(loads) // 4)].mean().item(), loads[-max(1, len(loads) // 4):].mean().item()
    print(f"activated experts per token: mean {loads.mean().item():.3f}, first quarter of the evaluations {first:.3f}, "
          f"last quarter {last:.3f}; per class " +
          ", ".join(f"{c}: {loads[:, labels == c].mean().item():.2f}" for c in range(ds.num_classes)))
    print(f"wrote {out}")
    return loads


if __name__ == "__main__":
    main()
