"""`trainer:` the optimisation loop, its intervals, checkpoints and divergence guard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from train.schema.keys import key


# accelerate's trackers (accelerate.utils.LoggerType) and the package each needs.
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "comet_ml": "comet_ml", "mlflow": "mlflow",
            "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab"}


def tracker_list(value: Any) -> list[str]:
    """trainer.log_with as a list of tracker names: none -> [], a name -> [it], a list as it is."""
    if value is None or value == "none":
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


@dataclass
class TrainerConfig:
    max_steps: int = key(2000, "optimizer steps to train", ge=1, example=5000)
    max_minutes: Optional[float] = key(None, "wall-clock budget in minutes; stops with a checkpoint and samples (null: none)", gt=0, example=60)
    batch_size: int = key(64, "GLOBAL batch per optimizer step, over all processes and accumulation steps", ge=1, example=64)
    grad_accum: int = key(1, "micro-batches accumulated per optimizer step", ge=1, example=2)
    lr: float = key(1e-3, "AdamW learning rate", gt=0, le=1, example=1e-4)
    betas: List[float] = key([0.9, 0.999], "AdamW betas: two values, each in [0, 1)", ge=0, lt=1, length=2, example="[0.9,0.999]")
    # Decoupled decay shrinks weights by lr x weight_decay per step; above 1 it is never sensible.
    weight_decay: float = key(0.0, "AdamW weight decay", ge=0, le=1, example=0.01)
    grad_clip: Optional[float] = key(None, "max gradient norm (null: no clipping)", gt=0, example=1.0)
    ema_decay: float = key(0.999, "EMA decay of the sampled weights", ge=0, le=1, example=0.9999)
    ema_warmup: bool = key(True, "timm's EMA warm-up: the decay grows with the step")
    mixed_precision: str = key("no", "autocast precision", choices=("no", "bf16", "fp16"), example="bf16")
    cpu: bool = key(False, "force the CPU even when a GPU is visible")
    # Configs saved before these keys existed ran DDP without checkpointing, the defaults.
    distributed: str = key("ddp", "how several processes share a run: ddp (each holds the whole model) | fsdp (accelerate's FSDP2: "
                           "parameters, gradients and AdamW state sharded over the processes; needs >= 2)", choices=("ddp", "fsdp"),
                           example="fsdp")
    gradient_checkpointing: bool = key(False, "recompute each block's activations in the backward pass (less memory, about a third "
                                       "more compute), for every backbone family and fine-tuned model")
    # Configs written before the modes existed said true (blocks) or false (off); both still mean that.
    compile: Any = key("off", "torch.compile: off | blocks (each block compiled) | model (the whole denoiser in one graph)",
                       choices=("off", "blocks", "model", True, False), example="model")
    compile_regions: bool = key(False, "with trainer.compile=model, compile each distinct block once and reuse it for the blocks like "
                                "it (torch.compiler.nested_compile_region): shorter compiles for deep models")
    cuda_graphs: bool = key(False, "capture the compiled step as CUDA graphs (needs trainer.compile=model and a CUDA GPU; "
                            "otherwise one line says why and the step runs without them)")
    log_every: int = key(10, "steps between metrics.jsonl lines", ge=1, example=100)
    # A name or a list (trainer.log_with=[tensorboard,wandb]); metrics.jsonl is written whatever this says.
    log_with: Any = key("tensorboard", "experiment trackers through accelerate: none | tensorboard | wandb | mlflow | comet_ml | "
                        "clearml | dvclive | swanlab | trackio, or a list; offline where the tracker has a mode (wandb)",
                        example="[tensorboard,wandb]")
    sample_every: int = key(500, "steps between preview grids (0: off); sample.every, when set, replaces it", ge=0, example=1000)
    ckpt_every: int = key(500, "steps between checkpoints, plus one at the end (0: no checkpoints)", ge=0, example=1000)
    keep_checkpoints: int = key(2, "checkpoints kept in run_dir/checkpoints (the newest; the one `latest` names is never deleted)", ge=1, example=3)
    max_bad_steps: int = key(20, "consecutive steps with a non-finite loss or gradient (each skipped) before the run stops", ge=1, example=50)
    # Healthy runs of every family change their weight norm by a few percent between checkpoints (tests/test_divergence.py).
    max_weight_growth: Optional[float] = key(10.0, "a checkpoint whose weight norm exceeds this many times the largest of the "
                                             "last 5 (the run's start and its checkpoints since) is not saved, and the run "
                                             "stops (null: no check)", gt=1, example=100)
