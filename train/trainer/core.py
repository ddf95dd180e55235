"""The Trainer: EDM (or flow) loss on any backbone with TREAD routing, on HF accelerate.

It is put together from one class per concern (docs/architecture.md, "The trainer"): SetUp (checks, objects, first
writes), Resume, Batches (what a step reads), Step (the hot path, no host read), Guard (the divergence guard on the
device, and the host reads) and Loop (progress, logging, checkpoints, previews).
"""

from __future__ import annotations

import weakref
from pathlib import Path

from accelerate import Accelerator
from accelerate.state import AcceleratorState
from omegaconf import DictConfig

from routing import ConfigError
from train.distributed import fsdp_accelerator
from train.rundir import HydraRecord, RunDirClaim, check_run_dir
from train.build import absolute_paths
from train.schema.trainer import tracker_list
from train.trainer.draws import Batches
from train.trainer.guard import Guard
from train.trainer.loop import Loop
from train.trainer.resume import Resume
from train.trainer.setup import SetUp, check_config
from train.trainer.step import Step


class Trainer(SetUp, Resume, Batches, Step, Guard, Loop):
    def __init__(self, cfg: DictConfig, accelerator: Accelerator | None = None, record: HydraRecord | None = None):
        """Check everything, then write: a refused run leaves every byte on disk as it was (docs/training.md,
        "Run folders"). `record`: Hydra's record of the command, written to <run_dir>/.hydra once checks passed."""
        self.cfg = cfg
        t = cfg.trainer
        if t.mixed_precision not in ("no", "bf16", "fp16"):
            raise ConfigError(f"trainer.mixed_precision='{t.mixed_precision}' is unknown; choose no, bf16 or fp16.")
        if accelerator is None:
            # accelerate keeps one process-wide state; several Trainers in one process (tests, the
            # benchmark grid) may ask for different precisions, so drop it (the process group stays).
            AcceleratorState._reset_state()
            # Trackers (trainer.log_with) log under run_dir/tb; configs saved before the key existed used TensorBoard.
            # trainer.distributed=fsdp: accelerate's FSDP2 plugin shards the model that `prepare` is given.
            make = fsdp_accelerator if t.get("distributed", "ddp") == "fsdp" else Accelerator
            accelerator = make(cpu=t.cpu, mixed_precision=t.mixed_precision, gradient_accumulation_steps=t.grad_accum,
                               log_with=tracker_list(t.get("log_with", "tensorboard")) or None,
                               project_dir=str(Path(cfg.run_dir) / "tb"))
        self.acc = accelerator
        check_config(cfg, self.acc.num_processes, self.acc.device)
        absolute_paths(cfg)
        self.run_dir = check_run_dir(cfg.run_dir)
        # An existing folder is locked (not written) while it is checked; the lock is committed with the first write.
        self._claim = RunDirClaim(self.run_dir) if self.acc.is_main_process else None
        if self._claim is not None:
            weakref.finalize(self, self._claim.release)
        try:
            self._set_up()
            self._commit(record)
        except BaseException:
            self._release_run_dir()
            raise
