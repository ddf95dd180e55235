"""Fine-tuning step cost of pretrained-architecture transformers, routed vs unrouted, in one run.

    python -m train.bench.finetune --models flux sd3 pixart dit wan --threads 2

Each model is built from a config with random weights (no download): a mid-size member of its family
(512 wide, 12 blocks; Flux: 4 double + 8 single), LoRA rank 16 on the attention projections (or full
fine-tuning with --train full). One step is the rectified-flow loss forward and backward on fixed data;
routed means TREAD's SimpleTuner starting point, ratio 0.5 over blocks 2..-2 with the random policy. Wan denoises
--frames latent frames at half the latent side, so its video has as many tokens as the image families' latents.
Steps are timed interleaved (medians); FLOPs come from torch.utils.flop_counter.
"""

from __future__ import annotations

import platform

import torch

from backbones.adapters import adapt, add_lora
from edm import FlowLoss
from routing import Router
from routing import count_flops
from routing.policy import POLICIES
from train.bench.timing import interleaved_medians
from train.cli import ArgumentParser, bounded, device as device_type, friendly_errors

# Mid-size configs: FLUX.1 / SD3.5 / PixArt-Sigma / DiT block types at 512 channels (8 heads of 64).
PRESETS = {
    "mid": {
        "flux": dict(patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=64,
                     num_attention_heads=8, joint_attention_dim=512, pooled_projection_dim=256, axes_dims_rope=(8, 28, 28)),
        "sd3": dict(sample_size=64, patch_size=2, in_channels=16, num_layers=12, attention_head_dim=64, num_attention_heads=8,
                    joint_attention_dim=512, caption_projection_dim=512, pooled_projection_dim=256, out_channels=16,
                    pos_embed_max_size=96, dual_attention_layers=(0, 1, 2, 3), qk_norm="rms_norm"),
        "pixart": dict(num_attention_heads=8, attention_head_dim=64, in_channels=4, out_channels=8, num_layers=12,
                       cross_attention_dim=512, sample_size=64, patch_size=2, caption_channels=512),
        "dit": dict(num_attention_heads=8, attention_head_dim=64, in_channels=4, out_channels=8, num_layers=12,
                    sample_size=32, patch_size=2, num_embeds_ada_norm=1000),
        "wan": dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16, text_dim=512,
                    freq_dim=256, ffn_dim=2048, num_layers=12, rope_max_seq_len=256),
    },
    # A smoke-test size: seconds on a CPU.
    "tiny": {
        "flux": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                     num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6)),
        "sd3": dict(sample_size=16, patch_size=2, in_channels=4, num_layers=5, attention_head_dim=16, num_attention_heads=2,
                    joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
                    pos_embed_max_size=32),
        "pixart": dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=5,
                       cross_attention_dim=32, sample_size=16, patch_size=2, caption_channels=32),
        "dit": dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=5,
                    sample_size=16, patch_size=2, num_embeds_ada_norm=10),
        "wan": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=32,
                    freq_dim=16, ffn_dim=48, num_layers=5, rope_max_seq_len=32),
    },
}
MODEL_CLASSES = {"flux": "FluxTransformer2DModel", "sd3": "SD3Transformer2DModel",
                 "pixart": "PixArtTransformer2DModel", "dit": "DiTTransformer2DModel", "wan": "WanTransformer3DModel"}


def build(family: str, preset: str):
    import diffusers

    return getattr(diffusers, MODEL_CLASSES[family])(**PRESETS[preset][family])


def latent_channels(family: str, config: dict) -> int:
    return config["in_channels"] // 4 if family == "flux" else config["in_channels"]  # Flux packs 2x2 patches


def conditioning(family: str, config: dict, batch: int, text: int, g: torch.Generator) -> dict | torch.Tensor:
    if family == "dit":
        return torch.randint(0, config["num_embeds_ada_norm"], (batch,), generator=g)
    width = config.get("joint_attention_dim") or config.get("caption_channels") or config.get("text_dim")
    cond = {"encoder_hidden_states": torch.randn(batch, text, width, generator=g)}
    if family in ("flux", "sd3"):
        cond["pooled_projections"] = torch.randn(batch, config["pooled_projection_dim"], generator=g)
    return cond


def to(cond, device):
    return cond.to(device) if torch.is_tensor(cond) else {k: v.to(device) for k, v in cond.items()}


def measure(args, family: str) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build(family, args.preset)
    config = PRESETS[args.preset][family]
    if args.train == "lora":
        add_lora(model, rank=args.rank)
    params = [p for p in model.parameters() if p.requires_grad]
    routes = [{"selection_ratio": args.ratio, "start_layer_idx": args.start, "end_layer_idx": args.end}]
    net = adapt(model.to(device), policy=args.policy, routes=routes).train()
    routed_router, plain_router = net.router, Router()

    g = torch.Generator().manual_seed(0)
    c = latent_channels(family, config)
    # Wan: (B, C, frames, H/2, W/2), as many tokens as the images' (B, C, H, W) at 2x2 patches when frames = 4.
    shape = (c, args.frames, args.latent // 2, args.latent // 2) if family == "wan" else (c, args.latent, args.latent)
    x = torch.randn(args.batch, *shape, generator=g).to(device)
    t = torch.rand(args.batch, generator=g).to(device)
    noise = torch.randn(x.shape, generator=g).to(device)
    cond = to(conditioning(family, config, args.batch, args.text, g), device)
    loss = FlowLoss()

    def step(router: Router):
        def run():
            net.router = router
            router.generator = torch.Generator().manual_seed(1)  # the same subset every call
            loss(net, x, cond, t, noise).mean().backward()
            for p in params:
                p.grad = None
        return run

    fns = {"unrouted": step(plain_router), "routed": step(routed_router)}
    flops = {k: count_flops(fn, grad=True) for k, fn in fns.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
        seconds = interleaved_medians(fns, args.repeats, args.warmup, device)
    route = routed_router.routes[0]
    tokens = (args.latent // 2) ** 2 if family != "wan" else args.frames * (args.latent // 4) ** 2
    return {
        "model": family, "params_m": sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n) / 1e6,
        "trainable_m": sum(p.numel() for p in params) / 1e6, "depth": net.depth,
        "tokens": f"{tokens}+{args.text}" if family != "dit" else str(tokens),
        "route": f"r{route.start_layer_idx}->{route.end_layer_idx} x{route.selection_ratio}",
        "gflops_unrouted": flops["unrouted"] / 1e9, "gflops_routed": flops["routed"] / 1e9,
        "ideal": flops["unrouted"] / flops["routed"], "ms_unrouted": seconds["unrouted"] * 1e3,
        "ms_routed": seconds["routed"] * 1e3, "measured": seconds["unrouted"] / seconds["routed"],
    }


@friendly_errors  # a route that does not fit a model's depth: the adapter's one sentence
def main(argv=None) -> list[dict]:
    p = ArgumentParser(prog="python -m train.bench.finetune", description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODEL_CLASSES), choices=list(MODEL_CLASSES))
    p.add_argument("--preset", default="mid", choices=list(PRESETS))
    p.add_argument("--train", default="lora", choices=["lora", "full"], help="LoRA on the attention projections, or all weights")
    p.add_argument("--rank", type=bounded(int, 1, example="--rank 16"), default=16)
    p.add_argument("--latent", type=bounded(int, 2, example="--latent 32"), default=32, help="latent side; 32 with 2x2 patches gives 256 image tokens")
    p.add_argument("--text", type=bounded(int, 1, example="--text 64"), default=64, help="text tokens (Flux, SD3, PixArt, Wan)")
    p.add_argument("--frames", type=bounded(int, 1, example="--frames 4"), default=4, help="Wan's latent frames (at half the latent side)")
    p.add_argument("--batch", type=bounded(int, 1, example="--batch 1"), default=1)
    p.add_argument("--policy", default="random", choices=[name for name in POLICIES if name != "none"],
                   help="the routed side's policy (the unrouted side is the comparison)")
    p.add_argument("--ratio", type=bounded(float, 0.01, 0.99, example="--ratio 0.5"), default=0.5)
    p.add_argument("--start", type=int, default=2)
    p.add_argument("--end", type=int, default=-2)
    p.add_argument("--repeats", type=bounded(int, 1, example="--repeats 3"), default=3)
    p.add_argument("--warmup", type=bounded(int, 0, example="--warmup 1"), default=1)
    p.add_argument("--device", type=device_type, default="cpu")
    p.add_argument("--bf16", action="store_true", help="autocast to bf16 (GPU)")
    p.add_argument("--threads", type=bounded(int, 1, example="--threads 2"), default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.latent % 2:
        p.error(f"--latent {args.latent} is not a multiple of the models' 2x2 patches (e.g. --latent {args.latent - 1})")
    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"cpu ({platform.processor() or platform.machine()}), threads={torch.get_num_threads()}"
    print(f"fine-tuning step (flow loss, forward+backward) | {args.train} | preset={args.preset} | batch={args.batch} | "
          f"policy={args.policy} | {where} | bf16={args.bf16} | torch {torch.__version__}")
    header = ("| model | params (M) | trainable (M) | blocks | tokens (image+text) | route | GFLOPs unrouted | GFLOPs routed | "
              "ideal speedup | ms unrouted | ms routed | measured speedup |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    rows = []
    for family in args.models:
        r = measure(args, family)
        rows.append(r)
        print(f"| {r['model']} | {r['params_m']:.2f} | {r['trainable_m']:.2f} | {r['depth']} | {r['tokens']} | {r['route']} | "
              f"{r['gflops_unrouted']:.1f} | {r['gflops_routed']:.1f} | {r['ideal']:.2f}x | {r['ms_unrouted']:.0f} | "
              f"{r['ms_routed']:.0f} | {r['measured']:.2f}x |", flush=True)
    return rows


if __name__ == "__main__":
    main()
