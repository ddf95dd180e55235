"""Shared fixtures: Hydra composition of the real configs, and small, fast overrides for CPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Triton kernels are checked against their PyTorch references on the CPU through Triton's interpreter.
# It must be chosen before any kernel module is imported; a CUDA machine runs the compiled kernels instead.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hydra import compose, initialize_config_dir

import train.schema  # noqa: F401  (registers the typed schema, `base_config`, with Hydra's ConfigStore)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# Few steps, small batches, no previews: enough to exercise a whole run on a 2-core CPU.
FAST = [
    "trainer.max_steps=2",
    "trainer.batch_size=4",
    "trainer.sample_every=0",
    "trainer.ckpt_every=0",
    "trainer.log_every=1",
    "trainer.cpu=true",
    "sample.per_class=1",
    "sample.steps=2",
]

torch.set_num_threads(1)


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_module(module: str, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m module args` from the repo root, as a user would."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


@pytest.fixture
def cfg_factory(tmp_path):
    def make(*overrides: str):
        return compose_cfg(*FAST, f"run_dir={tmp_path / 'run'}", *overrides)

    return make
