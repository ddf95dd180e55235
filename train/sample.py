"""`python -m train.sample RUN_OR_CHECKPOINT`: sample a class-conditional image grid from EMA weights.

    python -m train.sample runs/2026-11-22_10-00-00 --guidance 2 --steps 40 --seed 0 --out grid.png
    python -m train.sample runs/X --route-ratio 0.5                        # routed inference: cheaper evaluations
    python -m train.sample runs/X --rg-scale 2 --rg-gamma1 0.3 --rg-gamma2 0.7   # routing guidance (TREAD)
    python -m train.sample runs/X --moe-target 1.0                         # DiffMoE: 1 expert per token on average
    python -m train.sample runs/X --pdg-scale 2                            # SPRINT: path-drop guidance instead of CFG
    python -m train.sample runs/flux-lora --prompt "a photo of sks dog" --size 768x1024   # fine-tuned text-to-image runs
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from backbones.diffmoe import set_inference_capacity
from edm import generate, with_path_drop_guidance, with_routing_guidance
from edm.guidance import CFGDenoiser
from routing import ConfigError
from routing.router import count_flops
from train.build import objective_name, sampling_objective
from train.checkpoint import load_run
from train.cli import ArgumentParser, add_sampling_rule_flags, bounded, check_sampling_rule_flags, device, friendly_errors, writable_file
from train.data.prompts import encode_table, text_pipeline_of
from train.grid import grid_labels, save_grid


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m train.sample", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="run folder (uses its latest checkpoint) or a checkpoint folder")
    parser.add_argument("--guidance", type=bounded(float, 0, 100, example="--guidance 2"), default=1.0, help="classifier-free guidance scale w (1 = off)")
    parser.add_argument("--steps", type=bounded(int, 1, example="--steps 40"), default=40, help="sampler steps (network evaluations: 1 per Euler step, 2 per Heun step)")
    parser.add_argument("--sampler", default="heun", choices=["heun", "euler"])
    parser.add_argument("--objective", choices=["edm", "flow"], help="refuse the checkpoint unless it was trained with this objective")
    parser.add_argument("--seed", type=bounded(int, 0, example="--seed 0"), default=0)
    parser.add_argument("--per-class", type=bounded(int, 1, 1024, example="--per-class 8"), default=8, help="samples per class (one grid row per class)")
    parser.add_argument("--classes", type=int, nargs="*", help="class ids to sample (default: all)")
    parser.add_argument("--prompt", action="append", help="a prompt to sample (repeat for more; one grid row each): fine-tuned "
                        "text-to-image runs, encoded with the text encoders the run was conditioned with")
    parser.add_argument("--flux-guidance", type=bounded(float, 0, 100, example="--flux-guidance 3.5"),
                        help="Flux's distilled guidance for a guidance-embedding model (FLUX.1-dev; default: the run's finetune.guidance)")
    parser.add_argument("--size", type=pixel_size, help="image size WIDTHxHEIGHT in pixels (captioned runs; default: their most "
                        "common bucket)")
    add_sampling_rule_flags(parser)
    parser.add_argument("--rg-bad", help="routing guidance: a weaker checkpoint as the weak branch (autoguidance-style)")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--out", type=writable_file, help="PNG path, or for video runs .gif or .mp4 (default: "
                        "<checkpoint>/samples_w<guidance>_seed<seed>.png, .gif for video)")
    args = parser.parse_args(argv)
    check_sampling_rule_flags(parser, args)
    return args


@friendly_errors
def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    loaded = load_run(args.checkpoint, args.device)
    out = args.out or loaded.checkpoint / f"samples_w{args.guidance:g}_seed{args.seed}.png"
    if args.out is None and not os.access(out.parent, os.W_OK | os.X_OK):  # checked before sampling, not after
        raise ConfigError(f"cannot write the grid to {str(out.parent)!r} (not writable); pass --out PATH in a folder you can write to.")
    trained = objective_name(loaded.cfg)
    if args.objective and args.objective != trained:
        raise ConfigError(f"checkpoint '{loaded.checkpoint}' was trained with objective={trained}, not --objective {args.objective}; "
                          f"drop the flag or pass --objective {trained}.")
    ds, net, router = loaded.dataset, loaded.net, loaded.net.model.router
    classes, shape = ds.num_classes, latent_shape(ds, args.size)
    if args.prompt:
        if args.classes:
            raise ConfigError("give --prompt or --classes, not both.")
        # Encoded as the run's own conditioning was: the same text encoders and number of text tokens.
        table = encode_table(loaded.cfg.finetune.family, text_pipeline_of(loaded.cfg), args.prompt, device=args.device,
                             like=net.model.encoder_hidden_states)
        net.model.use_table({k: v.to(args.device) for k, v in table.tensors.items()})
        classes = table.num_classes  # one row per prompt; row P is the empty prompt, CFG's unconditional branch
        labels = torch.arange(classes).repeat_interleave(args.per_class)
    elif args.classes:
        bad = [c for c in args.classes if not 0 <= c < ds.num_classes]
        if bad:
            raise ConfigError(f"--classes {bad} out of range; this model has classes 0..{ds.num_classes - 1}.")
        labels = torch.tensor(args.classes).repeat_interleave(args.per_class)
    else:
        labels = grid_labels(getattr(ds, "preview_classes", ds.num_classes), args.per_class)
    if args.flux_guidance is not None:
        set_flux_guidance(loaded, args.flux_guidance)
    if args.moe_threshold is not None or args.moe_target is not None:
        set_inference_capacity(net, threshold=args.moe_threshold, target=args.moe_target)
    bad = load_run(args.rg_bad, args.device).net if args.rg_bad else None
    sampled = with_routing_guidance(net, router, args.rg_scale, args.rg_gamma1, args.rg_gamma2, unconditional=args.rg_uncond,
                                    null_label=classes, bad_net=bad, bad_router=bad.model.router if bad else None)
    sampled = with_path_drop_guidance(sampled, router, args.pdg_scale, classes)
    report_flops(net, sampled, router, args, shape, classes)
    objective = sampling_objective(loaded.cfg, loaded.objective, net.model, shape)  # a fine-tuning run's grid shift
    x = generate(sampled, labels, shape=shape, steps=args.steps, guidance=args.guidance, seed=args.seed, device=args.device,
                 sampler=args.sampler, null_label=classes, progress=True, objective=objective, router=router,
                 route_ratio=args.route_ratio)
    out = save_grid(ds.to_images(x), out, per_row=args.per_class)  # video samples: an animated grid, GIF or MP4
    print(f"wrote {out} ({len(labels)} samples, step {loaded.step}, objective {trained}, guidance {args.guidance:g})")
    return out


def set_flux_guidance(loaded, value: float) -> None:
    adapter = getattr(loaded.net.model, "adapter", loaded.net.model)
    if getattr(adapter, "family", None) != "flux" or not adapter.model.config.guidance_embeds:
        raise ConfigError("--flux-guidance is the distilled guidance of a guidance-embedding Flux (FLUX.1-dev), which this run did not "
                          "fine-tune; drop it (use --guidance for classifier-free guidance).")
    adapter.guidance = value


def pixel_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT in pixels (e.g. --size 768x1024)") from None
    if width < 1 or height < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive (e.g. --size 768x1024)")
    return width, height


def latent_shape(ds, size: tuple[int, int] | None) -> tuple[int, ...]:
    """The sampled shape: the dataset's, or (C, H/f, W/f) of a pixel size for a captioned run (f: its VAE's factor)."""
    if size is None:
        return ds.shape
    if not hasattr(ds, "space"):
        raise ConfigError("--size is for runs trained on captioned folders (data=captions); this run samples its data's shape.")
    factor, width, height = ds.space["factor"], *size
    if width % factor or height % factor:
        raise ConfigError(f"--size {width}x{height} must be a multiple of the VAE's factor {factor} on each side.")
    return (ds.shape[0], height // factor, width // factor)


def report_flops(net, sampled, router, args, shape, classes) -> None:
    """FLOPs of one sampler evaluation per image with the chosen rule (CFG, routing or path-drop guidance), beside
    the plain network's and CFG's (two full evaluations: conditional and null label)."""
    x = torch.zeros(1, *shape, device=args.device)
    t, label = torch.ones(1, device=args.device), torch.zeros(1, dtype=torch.long, device=args.device)
    with router.forced(0.0):
        plain = count_flops(lambda: net(x, t, label))
        cfg = count_flops(lambda: CFGDenoiser(net, 2.0, classes)(x, t, label))
    denoiser = CFGDenoiser(sampled, args.guidance, classes)
    # Sampling runs in eval mode, where routes are off unless forced (as `generate` does with route_ratio).
    with router.forced(args.route_ratio) if args.route_ratio else nullcontext():
        used = count_flops(lambda: denoiser(x, t, label))
    print(f"FLOPs per image per sampler evaluation: {used / 1e9:.4f} G; the unguided network {plain / 1e9:.4f} G "
          f"({used / plain:.2f}x); CFG {cfg / 1e9:.4f} G ({used / cfg:.2f} of CFG's)")


if __name__ == "__main__":
    main()
