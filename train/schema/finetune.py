"""`finetune:` fine-tune a pretrained diffusers transformer instead of training `backbone` from scratch (docs/finetuning.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from train.schema.keys import REFUSE, group, key

FAMILIES = ("flux", "sd3", "pixart", "dit", "wan")
TEXT_FAMILIES = ("flux", "sd3", "pixart", "wan")  # conditioned through a prompt table; DiT takes class labels
SHIFTS = ("none", "fixed", "resolution")


@dataclass
class LoraConfig:
    rank: int = key(16, "LoRA rank r", ge=1, le=4096, example=16, on_resume=REFUSE)
    alpha: Optional[float] = key(None, "LoRA alpha; the update is scaled by alpha / rank (null: alpha = rank)", gt=0, le=65536,
                                 example=16, on_resume=REFUSE)
    dropout: float = key(0.0, "dropout on the LoRA branch's input", ge=0, lt=1, example=0.1)
    # A preset name or a list of layer names (matched inside the blocks); checked against the adapters' presets.
    targets: Any = key("attention", "layers with LoRA: attention | attention_mlp | all_linear, or a list of layer names "
                       "inside the blocks, e.g. [to_q,to_k,to_v,proj_mlp]", example="attention_mlp", on_resume=REFUSE)


@dataclass
class FinetuneConfig:
    # Paths may change on resume (a moved folder); what they hold is checked: the pretrained model's config
    # against the checkpoint's, the prompt table against the model and the data.
    family: Optional[str] = key(None, "pretrained family to fine-tune: flux | sd3 | pixart | dit | wan (video) (null: train `backbone` from scratch)",
                                choices=FAMILIES, example="flux", on_resume=REFUSE)
    pretrained: Optional[str] = key(None, "local folder of the diffusers transformer, or of its pipeline (with transformer/)",
                                    example="weights/FLUX.1-dev")
    prompts: Optional[str] = key(None, "prompt table of the class prompts (flux, sd3, pixart), from python -m train.encode_prompts",
                                 example="prompts/flux.safetensors")
    train: str = key("lora", "what trains: lora (base frozen) | full (every weight)", choices=("lora", "full"), example="lora",
                     on_resume=REFUSE)
    dtype: str = key("fp32", "dtype of the frozen base weights (bf16 needs trainer.mixed_precision=bf16); trained weights stay fp32",
                     choices=("fp32", "bf16"), example="bf16")
    gradient_checkpointing: bool = key(False, "recompute each block's activations in the backward pass (less memory, more time)")
    guidance: float = key(1.0, "Flux's distilled guidance given to a guidance-embedding model in training (FLUX.1-dev); "
                          "train.sample --flux-guidance sets it for sampling", ge=0, le=100, example=1.0)
    train_shift: str = key("none", "time shift of the training draws: none | fixed (objective.shift, SD3's) | resolution "
                           "(Flux's, from the image tokens)", choices=SHIFTS, example="resolution", on_resume=REFUSE)
    sample_shift: str = key("fixed", "time shift of the sampling grid: fixed (objective.shift) | resolution (Flux's)",
                            choices=SHIFTS[1:], example="resolution")
    lora: LoraConfig = group(LoraConfig, "LoRA settings (finetune.train=lora)")
