"""The whole config: run keys at the top, one typed group per section (configs/config.yaml fills in values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from train.schema.align import AlignConfig
from train.schema.backbone import BackboneConfig
from train.schema.edm import EDMConfig
from train.schema.fid import FIDConfig
from train.schema.finetune import FinetuneConfig
from train.schema.keys import REFUSE, group, key
from train.schema.routing import RoutingConfig
from train.schema.sample import SampleConfig
from train.schema.trainer import TrainerConfig


@dataclass
class Config:
    seed: int = key(0, "seed of weights, data order, noise and routing", ge=0, le=2**63 - 1, example=0, on_resume=REFUSE)
    run_dir: str = key("runs/${now:%Y-%m-%d_%H-%M-%S}", "output folder: config, metrics.jsonl, checkpoints, samples", example="runs/exp1")
    resume: Any = key(None, "null: fresh run | auto: continue the latest checkpoint if any | true: must continue | a checkpoint folder", example="auto")
    overwrite: bool = key(False, "a fresh run into a run_dir holding a run moves the old one aside to <run_dir>.old-<time> instead of refusing")
    backbone: BackboneConfig = group(BackboneConfig, "block family and size")
    routing: RoutingConfig = group(RoutingConfig, "TREAD token routing")
    finetune: FinetuneConfig = group(FinetuneConfig, "fine-tune a pretrained diffusers transformer instead of `backbone`")
    # Data and objective keys depend on the option (data.name, objective.name); their schemas are in
    # train/schema/data.py and objective.py, checked by check_config.
    data: Any = key(None, "dataset (data=digits|shapes|fashion_mnist|latents|captions|videos); keys per dataset, see train/schema/data.py")
    objective: Any = key(None, "training objective (objective=edm|flow); keys per objective, see train/schema/objective.py")
    edm: EDMConfig = group(EDMConfig, "EDM settings")
    trainer: TrainerConfig = group(TrainerConfig, "optimisation, intervals, checkpoints")
    sample: SampleConfig = group(SampleConfig, "training-time preview grids")
    fid: FIDConfig = group(FIDConfig, "periodic FID during training")
    align: AlignConfig = group(AlignConfig, "representation alignment beside the diffusion loss (docs/alignment.md)")
