"""The training loop (`python -m train`): the Trainer and what callers use beside it.

Where each part lives (docs/architecture.md, "The trainer"): core.py assembles the Trainer; setup.py checks and
builds; resume.py continues a checkpoint; draws.py holds the counter-based randomness and the batches; step.py the
optimizer step (the hot path, no host read); guard.py the divergence guard and the host reads; loop.py progress,
logging, checkpoints and previews.
"""

from train.trainer.core import Trainer
from train.trainer.draws import global_indices, seeded
from train.trainer.setup import check_config, flat_settings

__all__ = ["Trainer", "check_config", "flat_settings", "global_indices", "seeded"]
