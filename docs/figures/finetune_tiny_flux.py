"""Fine-tune a tiny Flux-shaped transformer with TREAD routing and LoRA, end to end on a CPU, through the Python API.

    python docs/figures/finetune_tiny_flux.py --steps 30 --out runs/tiny-flux-lora
    python docs/figures/finetune_tiny_flux.py --write-pretrained weights/tiny-flux --latent-channels 1   # only write the model

Without --pretrained, a tiny FluxTransformer2DModel with random weights is written to OUT/pretrained first and
loaded back from there, exactly as a downloaded FLUX.1 folder would be. The data are fixed random latents
and text embeddings (a stand-in for cached VAE latents and T5/CLIP embeddings); a force-keep mask marks
the centre of each latent, the region a masked loss would train on.

--write-pretrained DIR only writes the tiny random model, for `python -m train` to fine-tune from a local folder
(docs/finetuning.md); --latent-channels sets its input channels (Flux packs 2x2 latent pixels into a token).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel

from backbones.adapters import adapt, add_lora, load_lora, load_pretrained, lora_parameters, save_lora
from edm import FlowLoss, LogitNormalTime

TINY_FLUX = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=16,
                 num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrained", default=None, help="a local diffusers Flux transformer folder (default: write a tiny one)")
    p.add_argument("--out", default="runs/tiny-flux-lora")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-pretrained", metavar="DIR", help="only write a tiny random Flux transformer to DIR, and stop")
    p.add_argument("--latent-channels", type=int, default=16, help="with --write-pretrained: input channels (FLUX.1's VAE: 16)")
    args = p.parse_args(argv)
    out = Path(args.out)
    # Writing a model over an existing folder would change the base that runs fine-tuned from it were trained on.
    target = Path(args.write_pretrained) if args.write_pretrained else None if args.pretrained else out / "pretrained"
    if target is not None and target.exists():
        p.error(f"{target} already exists, and a run fine-tuned from it needs it as it is; pick another folder"
                + ("" if args.write_pretrained else f" (--out), or reuse the model with --pretrained {target}"))
    torch.manual_seed(args.seed)
    if args.write_pretrained:
        FluxTransformer2DModel(**{**TINY_FLUX, "in_channels": 4 * args.latent_channels}).save_pretrained(args.write_pretrained)
        print(f"wrote a tiny random FluxTransformer2DModel to {args.write_pretrained} (joint_attention_dim "
              f"{TINY_FLUX['joint_attention_dim']}, pooled_projection_dim {TINY_FLUX['pooled_projection_dim']})")
        return []

    # The pretrained model, from a local folder only.
    pretrained = args.pretrained
    if pretrained is None:
        pretrained = out / "pretrained"
        FluxTransformer2DModel(**TINY_FLUX).save_pretrained(pretrained)
    model = load_pretrained("flux", pretrained)

    # LoRA on the attention projections, base frozen; then TREAD routes over blocks 2..-2 (image tokens only).
    add_lora(model, rank=8)
    net = adapt(model, policy="random", routes=[{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]).train()
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-3)

    # Fixed data: 16-channel 16x16 latents (8x8 = 64 image tokens), 12 text tokens, a centre force-keep mask.
    g = torch.Generator().manual_seed(args.seed)
    latents = torch.randn(8, 16, 16, 16, generator=g)
    text = torch.randn(8, 12, TINY_FLUX["joint_attention_dim"], generator=g)
    pooled = torch.randn(8, TINY_FLUX["pooled_projection_dim"], generator=g)
    mask = torch.zeros(8, 16, 16, dtype=torch.bool)
    mask[:, 6:10, 6:10] = True  # latent pixels -> the 2x2 centre tokens

    loss_fn, time_dist, losses = FlowLoss(), LogitNormalTime(), []
    for step in range(args.steps):
        i = torch.randint(0, 8, (args.batch,), generator=g)
        x = latents[i]
        cond = {"encoder_hidden_states": text[i], "pooled_projections": pooled[i], "force_keep": mask[i]}
        t, noise = time_dist(args.batch, g), torch.randn(x.shape, generator=g)
        net.router.generator = torch.Generator().manual_seed(args.seed * 100_003 + step)  # per-step routing draw
        # Rectified flow: z_t = (1 - t) x + t eps, loss ||(eps - x) - v(z_t, t)||^2.
        loss = loss_fn(net, x, cond, t, noise).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}  processed {net.router.last_masks[0].float().mean():.2f} of the image tokens")

    # Adapter-only checkpoint, then a fresh copy of the pretrained model with it gives the same velocities.
    save_lora(model, out / "lora")
    fresh = load_pretrained("flux", pretrained)
    load_lora(fresh, out / "lora")
    x, t = latents[:2], torch.full((2,), 0.5)
    cond = {"encoder_hidden_states": text[:2], "pooled_projections": pooled[:2]}
    same = torch.equal(adapt(fresh).eval()(x, t, cond), net.eval()(x, t, cond))
    print(f"saved {out / 'lora'}; reloaded adapter reproduces the model exactly: {same}")
    return losses


if __name__ == "__main__":
    main()
