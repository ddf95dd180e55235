"""`python -m train.sample RUN_OR_CHECKPOINT`: sample a class-conditional image grid from EMA weights.

    python -m train.sample runs/2026-11-22_10-00-00 --guidance 2 --steps 40 --seed 0 --out grid.png
    python -m train.sample runs/X --route-ratio 0.5                        # routed inference: cheaper evaluations
    python -m train.sample runs/X --rg-scale 2 --rg-gamma1 0.3 --rg-gamma2 0.7   # routing guidance (TREAD)
    python -m train.sample runs/X --moe-target 1.0                         # DiffMoE: 1 expert per token on average
    python -m train.sample runs/X --pdg-scale 2                            # SPRINT: path-drop guidance instead of CFG
    python -m train.sample runs/flux-lora --prompt "a photo of sks dog" --size 768x1024   # fine-tuned text-to-image runs
    python -m train.sample runs/flux-lora --prompts-file prompts.txt       # one prompt per line (sample.prompts' file)
"""

from __future__ import annotations

import argparse
import hashlib
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
from train.checkpoint import load_run, resolve_checkpoint
from train.cli import ArgumentParser, add_sampling_rule_flags, bounded, check_sampling_rule_flags, device, friendly_errors, writable_file
from train.data.prompts import encode_table, text_pipeline_of
from train.data.validation_prompts import read_prompts_file, require_text_family
from train.grid import VIDEO_SUFFIXES, grid_labels, save_grid
from train.logger import recipe


# The sampling that documented numbers use; a run's own previews (sample.guidance, sample.steps) may differ, which
# `preview_notes` says rather than follows, so a command gives the same grid whichever run it samples.
DEFAULTS = {"guidance": 1.0, "steps": 40}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m train.sample", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="run folder (uses its latest checkpoint) or a checkpoint folder")
    # Default None: `preview_notes` tells a default from a flag the user gave; parse_args fills in DEFAULTS.
    parser.add_argument("--guidance", type=bounded(float, 0, 100, example="--guidance 2"),
                        help=f"classifier-free guidance scale w (1 = off; default {DEFAULTS['guidance']:g})")
    parser.add_argument("--steps", type=bounded(int, 1, example="--steps 40"),
                        help="sampler steps (network evaluations: 1 per Euler step, 2 per Heun step; default "
                             f"{DEFAULTS['steps']})")
    parser.add_argument("--sampler", default="heun", choices=["heun", "euler"])
    parser.add_argument("--objective", choices=["edm", "flow"], help="refuse the checkpoint unless it was trained with this objective")
    parser.add_argument("--seed", type=bounded(int, 0, example="--seed 0"), default=0)
    parser.add_argument("--per-class", type=bounded(int, 1, 1024, example="--per-class 8"), default=8, help="samples per class (one grid row per class)")
    parser.add_argument("--classes", type=int, nargs="*", help="class ids to sample (default: all)")
    parser.add_argument("--prompt", action="append", help="a prompt to sample (repeat for more; one grid row each): fine-tuned "
                        "text-to-image runs, encoded with the text encoders the run was conditioned with")
    parser.add_argument("--prompts-file", help="a text file with one prompt per line (the format of sample.prompts): one grid row "
                        "per prompt, as --prompt")
    parser.add_argument("--flux-guidance", type=bounded(float, 0, 100, example="--flux-guidance 3.5"),
                        help="Flux's distilled guidance for a guidance-embedding model (FLUX.1-dev; default: the run's finetune.guidance)")
    parser.add_argument("--size", type=pixel_size, help="image or frame size WIDTHxHEIGHT in pixels (runs on captioned "
                        "images or clips; default: their most common bucket, or the clips' size)")
    add_sampling_rule_flags(parser)
    parser.add_argument("--rg-bad", help="routing guidance: a weaker checkpoint as the weak branch (autoguidance-style)")
    parser.add_argument("--pretrained", help="a fine-tuning run's base model folder, where it lives now if it moved "
                        "(default: the run's finetune.pretrained)")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--out", type=writable_file, help="PNG path, or for video runs .gif or .mp4 (default: "
                        "<checkpoint>/samples_<rule>_<sampler><steps>_seed<seed>[...].png, a name that carries every "
                        "option that changes the samples; .gif for video)")
    parser.add_argument("--overwrite", action="store_true", help="replace the grid file if it exists (by default it is kept "
                        "and the command refuses)")
    args = parser.parse_args(argv)
    args.given = {name for name in DEFAULTS if getattr(args, name) is not None}
    for name in DEFAULTS.keys() - args.given:
        setattr(args, name, DEFAULTS[name])
    check_sampling_rule_flags(parser, args)
    if args.prompts_file is not None:
        if args.prompt:
            parser.error("give --prompt or --prompts-file, not both")
        # Read now: the default file name carries the digest of the prompts' text, whichever flag gave them.
        args.prompt = read_prompts_file(args.prompts_file, "--prompts-file")
    return args


@friendly_errors
def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = args.out or resolve_checkpoint(args.checkpoint) / default_name(args)
    if args.out is None and not os.access(out.parent, os.W_OK | os.X_OK):  # checked before sampling, not after
        raise ConfigError(f"cannot write the grid to {str(out.parent)!r} (not writable); pass --out PATH in a folder you can write to.")
    loaded = load_run(args.checkpoint, args.device, args.pretrained)
    shape = latent_shape(loaded.dataset, args.size, model_patch(loaded.net))
    if len(shape) == 4 and out.suffix.lower() not in VIDEO_SUFFIXES:
        out = out.with_suffix(".gif")  # video samples: save_grid writes an animated grid
    if out.exists() and not args.overwrite:
        raise ConfigError(f"'{out}' exists (samples of these options, or another grid); pass --overwrite to replace it, or "
                          "--out PATH to write elsewhere.")
    print(f"sampling a {recipe(loaded.cfg.routing)} model ({guidance_rule(args)})")
    trained = objective_name(loaded.cfg)
    if args.objective and args.objective != trained:
        raise ConfigError(f"checkpoint '{loaded.checkpoint}' was trained with objective={trained}, not --objective {args.objective}; "
                          f"drop the flag or pass --objective {trained}.")
    ds, net, router = loaded.dataset, loaded.net, loaded.net.model.router
    classes = ds.num_classes
    if args.prompt:
        flag = "--prompts-file" if args.prompts_file else "--prompt"
        if args.classes:
            raise ConfigError(f"give {flag} or --classes, not both.")
        require_text_family(loaded.cfg, flag, "sample its classes with --classes")
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
    for note in preview_notes(args, loaded.cfg):
        print(note)
    report_flops(net, sampled, router, args, shape, classes)
    objective = sampling_objective(loaded.cfg, loaded.objective, net.model, shape)  # a fine-tuning run's grid shift
    x = generate(sampled, labels, shape=shape, steps=args.steps, guidance=args.guidance, seed=args.seed, device=args.device,
                 sampler=args.sampler, null_label=classes, progress=True, objective=objective, router=router,
                 route_ratio=args.route_ratio)
    out = save_grid(ds.to_images(x), out, per_row=args.per_class)  # video samples: an animated grid, GIF or MP4
    print(f"wrote {out} ({len(labels)} samples, step {loaded.step}, objective {trained}, {guidance_rule(args)})")
    return out


def guidance_rule(args: argparse.Namespace) -> str:
    """The sampling rule in words, as the last line reports it."""
    parts = []
    if args.pdg_scale != 1:
        parts.append(f"path-drop guidance w={args.pdg_scale:g}")
    if args.rg_scale != 1:
        weak = f"--rg-bad {args.rg_bad}" if args.rg_bad else f"ratio {args.rg_gamma2:g}"
        both = ", both branches unconditional" if args.rg_uncond else ""
        parts.append(f"routing guidance w={args.rg_scale:g} (strong ratio {args.rg_gamma1 or 0:g}, weak {weak}{both})")
    if args.guidance != 1 or not parts:
        parts.append(f"CFG w={args.guidance:g}" if args.guidance != 1 else "no guidance")
    if args.route_ratio:
        parts.append(f"routed inference at ratio {args.route_ratio:g}")
    return "rule: " + " + ".join(parts)


def default_name(args: argparse.Namespace) -> str:
    """The grid's file name: every option that changes the samples, so two different samplings never share a file."""
    if args.pdg_scale != 1:
        rule = f"pdg{args.pdg_scale:g}"
    else:
        rule = f"cfg{args.guidance:g}"
        if args.rg_scale != 1:
            weak = f"bad{digest(str(args.rg_bad))}" if args.rg_bad else f"{args.rg_gamma2:g}"
            rule += f"_rg{args.rg_scale:g}-{args.rg_gamma1 or 0:g}-{weak}" + ("-uncond" if args.rg_uncond else "")
    parts = [rule]
    if args.route_ratio:
        parts.append(f"route{args.route_ratio:g}")
    if args.moe_threshold is not None:
        parts.append(f"moe-th{args.moe_threshold:g}")
    if args.moe_target is not None:
        parts.append(f"moe-t{args.moe_target:g}")
    parts += [f"{args.sampler}{args.steps}", f"seed{args.seed}", f"n{args.per_class}"]
    if args.classes:
        parts.append("c" + ("-".join(map(str, args.classes)) if len(args.classes) <= 4 else digest(" ".join(map(str, args.classes)))))
    if args.prompt:
        parts.append("p" + digest("\n".join(args.prompt)))  # the prompts' text does not fit a file name; its digest does
    if args.size:
        parts.append("{}x{}".format(*args.size))
    if args.flux_guidance is not None:
        parts.append(f"fg{args.flux_guidance:g}")
    return "samples_" + "_".join(parts) + ".png"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


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


def latent_shape(ds, size: tuple[int, int] | None, patch: int = 1) -> tuple[int, ...]:
    """The sampled shape: the dataset's, or of a pixel size for a run on captioned images, (C, H/f, W/f), or clips,
    (C, T', H/f, W/f) with the clips' latent frames (f: the VAE's spatial factor). `patch`: the model's patch side in
    latent pixels, which each side must hold a whole number of."""
    if size is None:
        return ds.shape
    if not hasattr(ds, "space"):
        raise ConfigError("--size is for runs trained on captioned images or clips (data=captions, data=videos); this "
                          "run samples its data's shape, so drop --size.")
    video = len(ds.shape) == 4
    factor = ds.space["spatial" if video else "factor"]  # the video cache names its spatial and temporal factors apart
    (width, height), step = size, factor * patch
    if width % step or height % step:
        near = [max(step, (side + step // 2) // step * step) for side in (width, height)]  # the nearest, halves up
        raise ConfigError(f"--size {width}x{height} is not a multiple of {step} on each side (the VAE's factor "
                          f"{factor} x the model's patch {patch}); use --size {near[0]}x{near[1]}.")
    return (*ds.shape[:-2], height // factor, width // factor)


def model_patch(net) -> int:
    """The model's patch side in latent pixels (height and width; a video model's (t, h, w) patch gives h)."""
    model = net.model
    patch = getattr(model, "patch", None) or getattr(model, "patch_size", 1)
    return int(patch[-1] if isinstance(patch, (tuple, list)) else patch)


def preview_notes(args: argparse.Namespace, cfg) -> list[str]:
    """One line per sampling setting left at its default that differs from the run's own previews (sample.guidance,
    sample.steps): the defaults stay, so a grid is comparable across runs, but the user learns how to match them."""
    preview = cfg.get("sample") or {}
    notes = []
    for name in ("guidance", "steps"):
        theirs = preview.get(name)
        if name in args.given or theirs is None or float(theirs) == float(getattr(args, name)):
            continue
        if name == "guidance" and args.pdg_scale != 1:
            continue  # path-drop guidance takes CFG's place: --guidance is refused beside it
        ours = getattr(args, name)
        notes.append(f"note: {name} {ours} (this run's previews use {theirs}: --{name} {theirs:g} for those)")
    return notes


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
