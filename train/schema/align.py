"""`align:` representation alignment beside the diffusion loss: none | repa | self (docs/alignment.md).

One group for the three modes (configs/align/*.yaml set the keys each one reads; the others keep their defaults
and are ignored). `check_align` refuses, in one sentence each: a block outside the stack, a self-alignment
teacher block that is not after the student's or that sits in a route the student is not in (an online teacher
there holds only the route's kept tokens), a missing encoder weights file (on pixel data), alignment on a fine-tuned
pretrained model. lambda < 0 is the range check of `align.weight`. Refused when the encoder or the dataset is
loaded, before training starts: a patch grid that cannot pool onto the token grid (train/metrics/encoder.py), and
REPA on a latents folder without the images or features it needs (train/metrics/alignment.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from routing.errors import ConfigError
from train.schema.keys import REFUSE, key

MODES = ("none", "repa", "self")


@dataclass
class AlignConfig:
    name: str = key("none", "representation alignment: none | repa (a frozen local encoder's patch features) | self (a later block of "
                    "the model itself)", choices=MODES, example="self", on_resume=REFUSE)
    layer: Optional[int] = key(1, "the aligned block: its output is aligned (0-based, negative counts from the end; REPA: block 8 of 28 of "
                               "SiT-XL/2, layer=7; null, self only: SRA's block scaled to the depth)", ge=-4096, le=4095, example=7,
                               on_resume=REFUSE)
    weight: float = key(0.5, "lambda, the weight of the alignment loss added to the diffusion loss (REPA: 0.5)", ge=0, example=0.5)
    projector_width: Optional[int] = key(2048, "hidden width of the projector (REPA: 2048; SRA: 2 x the model's width); null: the "
                                         "head's own", ge=1, le=65536, example=2048, on_resume=REFUSE)
    head: Optional[str] = key(None, "the projector: repa (REPA's Linear - SiLU - Linear - SiLU - Linear) | sra (SRA's Linear - SiLU - "
                              "Linear); null: the mode's own (repa: repa, self: sra)", choices=("repa", "sra"), example="sra",
                              on_resume=REFUSE)
    loss: Optional[str] = key(None, "cosine (REPA's negative cosine) | smooth_l1 (SRA's, beta 0.05); null: the mode's own",
                              choices=("cosine", "smooth_l1"), example="cosine", on_resume=REFUSE)
    encoder: str = key("vit_base_patch14_dinov2.lvd142m", "repa: timm name of the frozen encoder (REPA: DINOv2-B)",
                       example="vit_base_patch14_dinov2.lvd142m", on_resume=REFUSE)
    weights: Optional[str] = key(None, "repa: local weights of `encoder` (a .safetensors or .pth file), or a timm folder with config.json "
                                 "and model.safetensors; never downloaded", example="/weights/dinov2_vitb14.safetensors")
    input_size: int = key(224, "repa: the encoder's input side in pixels; its patch grid is pooled to the token grid (a whole multiple "
                          "of it)", ge=8, le=4096, example=224, on_resume=REFUSE)
    teacher_layer: Optional[int] = key(-3, "self: the teacher block, after `layer` (SRA: block 20 of 28; null: SRA's block scaled to "
                                       "the depth)", ge=-4096, le=4095, example=5, on_resume=REFUSE)
    teacher: str = key("ema", "self: ema (the EMA model at a lower noise level, SRA) | online (this forward's block, detached, LayerSync)",
                       choices=("ema", "online"), example="ema")
    teacher_gap: float = key(0.2, "self, teacher=ema: the teacher's flow time is t - teacher_gap * u, u ~ U[0, 1) (EDM: sigma = t / (1 - t)); "
                             "SRA: 0.2", ge=0, le=1, example=0.2)


def check_align(cfg: DictConfig) -> None:
    """Refuse an alignment that cannot run with this model, data and routes (ConfigError, one sentence)."""
    a = cfg.get("align")
    if a is None or a.name == "none":
        return
    if (cfg.get("finetune") or {}).get("family"):
        raise ConfigError(f"align={a.name} aligns the blocks of our own backbones, not a fine-tuned pretrained model; drop align "
                          "(align=none) or train a backbone from scratch (finetune.family=null).")
    if a.name == "repa":
        _check_encoder(cfg, a)
    from backbones import family_module
    from backbones.align import default_blocks
    from backbones.capture import check_layers
    from routing.route import resolve_routes

    b = cfg.backbone
    depth = b.depth if b.get("depth") is not None else family_module(b.name).PRESETS[b.preset]["depth"]
    routes = resolve_routes(OmegaConf.to_container(cfg.routing.routes, resolve=True) or [], depth)
    layer, teacher_layer = default_blocks(a.name, a.layer, a.teacher_layer, depth)
    check_layers(routes, depth, layer, teacher_layer if a.name == "self" else None, a.teacher)


def _check_encoder(cfg: DictConfig, a: DictConfig) -> None:
    if (cfg.get("data") or {}).get("name") == "latents":
        return  # the folder's meta.json says what it holds (cached features need no weights); build_alignment checks it
    where = "put the encoder's weights (a .safetensors or .pth state dict of align.encoder, or a timm folder with config.json and model.safetensors) there"
    if a.weights is None:
        raise ConfigError(f"align=repa needs align.weights, local weights of {a.encoder} (nothing is downloaded): save them as a "
                          ".safetensors or .pth state dict (or a timm folder with config.json and model.safetensors) and pass the path, "
                          "e.g. align.weights=/weights/dinov2_vitb14.safetensors.")
    if not Path(str(a.weights)).expanduser().exists():
        raise ConfigError(f"align.weights={a.weights!r} does not exist; {where}, or pass the path where they are.")
