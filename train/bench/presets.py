"""Parameter counts of the presets sized after papers, beside the counts the papers report.

    python -m train.bench.presets                  # 256x256 images: 32x32x4 latents, patch 2, 1000 classes
    python -m train.bench.presets --latent 64      # 512x512 images (the count grows by the position table only)

Every model is built on PyTorch's meta device: shapes without storage, so the billion-parameter presets cost no
memory and the whole table takes a few seconds. The table of docs/presets.md is this command's output.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from backbones import build_backbone
from train.cli import ArgumentParser, bounded, check_tokens


@dataclass(frozen=True)
class Reference:
    family: str
    preset: str
    paper: str  # the model's name in its paper
    reported: float | None  # parameters the paper reports; None where no source at hand gives the count
    source: str  # where the width and depth (and the count) come from


TREAD = "TREAD (Krause et al. 2025, arXiv 2501.04765), ImageNet-256 table of its project page; size only"
# The H counts as sCM's ImageNet-512 comparison table quotes them (Lu & Song 2025, arXiv 2410.11081v2); the other
# sizes' counts were not at hand. Width and depth: each release's model definitions.
SCM = "count: sCM (arXiv 2410.11081v2), ImageNet-512 table"
DRWKV = "Diffusion-RWKV (Fei et al. 2024, arXiv 2404.04478); width, depth: feizc/Diffusion-RWKV models_drwkv.py"
DIS = "DiS (Fei et al. 2024, arXiv 2402.05608); width, depth: feizc/DiS models_dis.py"
DIM = "DiM (Teng et al. 2024, arXiv 2405.14224); width, depth: tyshiwo1/DiM-DiffusionMamba configs/imagenet256_{L,H}_DiM.py"

REFERENCES = [
    Reference("rwkv", "tread-210M", "RWKV", 210e6, TREAD),
    Reference("mamba", "tread-111M", "Mamba", 111e6, TREAD),
    *(Reference("rwkv", f"DRWKV-{s}", f"DRWKV-{s}/2", None, DRWKV) for s in "SBML"),
    Reference("rwkv", "DRWKV-H", "DRWKV-H/2", 779e6, f"{DRWKV}; {SCM}"),
    *(Reference("mamba", f"DiS-{s}", f"DiS-{s}/2", None, DIS) for s in "SBML"),
    Reference("mamba", "DiS-H", "DiS-H/2", 900e6, f"{DIS}; {SCM}"),
    Reference("mamba", "DiM-L", "DiM-L", None, DIM),
    Reference("mamba", "DiM-H", "DiM-H", 860e6, f"{DIM}; {SCM}"),
]


def count_parameters(family: str, preset: str, latent: int = 32, channels: int = 4, patch: int = 2,
                     classes: int = 1000) -> tuple[int, int]:
    """(all, adaLN-Zero's) parameters of `family` at `preset` for latent-by-latent inputs, built on the meta device.

    The adaLN-Zero share is reported apart: DiS and DiM condition through tokens instead, so it is most of the
    difference to their counts. The count does not depend on `latent`: the position table is a fixed buffer.
    """
    with torch.device("meta"):
        model = build_backbone(family, preset, input_size=latent, in_channels=channels, patch_size=patch,
                               num_classes=classes)
    modulation = sum(p.numel() for name, p in model.named_parameters() if ".adaLN." in f".{name}")
    return sum(p.numel() for p in model.parameters()), modulation


def rows(latent: int = 32, patch: int = 2, classes: int = 1000) -> list[dict]:
    """One row per reference: our count, the paper's, and the relative difference where the paper gives one."""
    out = []
    for ref in REFERENCES:
        ours, modulation = count_parameters(ref.family, ref.preset, latent=latent, patch=patch, classes=classes)
        difference = None if ref.reported is None else ours / ref.reported - 1
        out.append({"reference": ref, "ours": ours, "adaLN": modulation, "difference": difference})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| backbone | preset | paper's model | ours | of which adaLN-Zero | paper's count | difference | source |",
             "|---|---|---|---|---|---|---|---|"]
    for row in table:
        ref = row["reference"]
        reported = "not at hand" if ref.reported is None else f"{ref.reported / 1e6:.0f}M"
        difference = "" if row["difference"] is None else f"{row['difference']:+.1%}"
        lines.append(f"| {ref.family} | `{ref.preset}` | {ref.paper} | {row['ours'] / 1e6:.1f}M | {row['adaLN'] / 1e6:.1f}M "
                     f"| {reported} | {difference} "
                     f"| {ref.source} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m train.bench.presets", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latent", type=bounded(int, 1, example="--latent 32"), default=32, help="latent side (32 for 256x256 images with an 8x VAE)")
    parser.add_argument("--patch", type=bounded(int, 1, example="--patch 2"), default=2)
    parser.add_argument("--classes", type=bounded(int, 1, example="--classes 1000"), default=1000)
    args = parser.parse_args(argv)
    check_tokens(parser, args.latent, args.patch, side_flag="--latent")
    print(f"Parameters at {args.latent}x{args.latent}x4 latents, patch {args.patch}, {args.classes} classes "
          f"({(args.latent // args.patch) ** 2} tokens):\n")
    print(markdown(rows(args.latent, args.patch, args.classes)))


if __name__ == "__main__":
    main()
