"""Shared fixtures: Hydra composition of the real configs, and small, fast overrides for CPU runs."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import logging
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


def entry_point(module: str):
    """What `python -m module ARGV` calls, as a function of ARGV."""
    from train.cli import friendly_errors

    if module in ("train", "train.bench"):  # Hydra apps: `__main__.cli` checks the keys, then hands sys.argv to Hydra
        return importlib.import_module(f"{module}.__main__").cli
    main = importlib.import_module(module).main
    # fid and cache_latents wrap their main in friendly_errors under `if __name__ == "__main__"`, the others inside it
    return friendly_errors(main) if module in ("train.fid", "train.cache_latents") else main


@contextlib.contextmanager
def as_a_command(argv: list[str]):
    """sys.argv and the working directory (the repo root) as `python -m` has them, put back afterwards with the root
    logger: Hydra's job logging points new handlers at the streams of the moment, which a test replaces."""
    root = logging.getLogger()
    handlers, level, old_argv, cwd = root.handlers[:], root.level, sys.argv, os.getcwd()
    sys.argv = argv
    os.chdir(ROOT)
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.handlers[:], root.level, sys.argv = handlers, level, old_argv
        os.chdir(cwd)


def run_cli(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args` inside this test process: the same entry point, exit code and output as `run_module`,
    without the seconds of interpreter and torch start-up per call. Checks that need a real process (a kill, a lock
    held by another pid, a launcher) use `run_module`; test_schema keeps the two equal."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with as_a_command([module, *args]), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            entry_point(module)(list(args))
        except SystemExit as stop:
            if isinstance(stop.code, str):  # sys.exit("message"): printed to stderr, status 1, as Python does
                print(stop.code, file=sys.stderr)
            code = 1 if isinstance(stop.code, str) else stop.code or 0
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def cfg_factory(tmp_path):
    def make(*overrides: str):
        return compose_cfg(*FAST, f"run_dir={tmp_path / 'run'}", *overrides)

    return make


def folder_hash(folder: Path) -> str:
    """One digest of a folder's names and bytes: a refused resume or run must leave it exactly as it was."""
    digest = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        digest.update(str(p.relative_to(folder)).encode() + (p.read_bytes() if p.is_file() else b"/"))
    return digest.hexdigest()
