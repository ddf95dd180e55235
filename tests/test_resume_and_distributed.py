"""Exact resume after a killed run, and two processes (gloo on CPU) matching one with the same global batch."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from routing import ConfigError
from train.trainer import Trainer
from conftest import FAST, ROOT, compose_cfg, run_cli


def losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [ln["step"] for ln in lines]
    assert len(steps) == len(set(steps)), f"duplicated steps in metrics.jsonl: {steps}"
    return {ln["step"]: ln["loss"] for ln in lines}


def test_killed_run_resumes_with_the_same_loss_sequence(tmp_path):
    common = [*FAST, "trainer.max_steps=14", "routing=random", "trainer.batch_size=8"]
    straight = compose_cfg(*common, f"run_dir={tmp_path / 'straight'}")
    Trainer(straight).fit()

    # A run that would go on for long is killed (SIGKILL: no clean-up) once it has checkpointed step >= 6.
    killed = tmp_path / "killed"
    args = [*common, "trainer.max_steps=100000", "trainer.ckpt_every=3", f"run_dir={killed}"]
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and not (latest.exists() and int(latest.read_text().split("_")[-1]) >= 6):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt_step = int(latest.read_text().split("_")[-1])
    assert ckpt_step >= 6

    resumed = compose_cfg(*common, f"run_dir={killed}", "resume=true")
    Trainer(resumed).fit()
    expected, got = losses(tmp_path / "straight"), losses(killed)
    assert sorted(got) == list(range(1, 15))
    for step in range(1, 15):
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step


def test_resume_refuses_a_checkpoint_from_another_config(tmp_path):
    run = tmp_path / "run"
    Trainer(compose_cfg(*FAST, "trainer.ckpt_every=2", f"run_dir={run}")).fit()
    with pytest.raises(ConfigError, match=r"different backbone config \(differs in backbone.depth"):
        Trainer(compose_cfg(*FAST, f"run_dir={run}", "resume=true", "backbone.depth=4"))
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        Trainer(compose_cfg(*FAST, f"run_dir={tmp_path / 'empty'}", "resume=true"))
    # A damaged weights file is named, and the run directory is left as it was.
    ckpt = next((run / "checkpoints").glob("step_*"))
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    before = sorted(p.name for p in run.rglob("*"))
    with pytest.raises(ConfigError, match="model.safetensors' is not a safetensors file"):
        Trainer(compose_cfg(*FAST, f"run_dir={run}", "resume=true"))
    assert sorted(p.name for p in run.rglob("*")) == before


def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    args = [*FAST, "trainer.max_steps=3", "trainer.batch_size=8", "trainer.ckpt_every=3"]
    one = run_cli("train", *args, f"run_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29561",
              "-m", "train", *args, f"run_dir={tmp_path / 'two'}"]
    two = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es)" in two.stdout
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys()
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5)
    wa = load_file(tmp_path / "one" / "checkpoints" / "step_0000003" / "model.safetensors")
    wb = load_file(tmp_path / "two" / "checkpoints" / "step_0000003" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_sample_command_writes_a_grid_from_ema_weights(tmp_path):
    run = tmp_path / "run"
    Trainer(compose_cfg(*FAST, "trainer.ckpt_every=2", "trainer.sample_every=2", f"run_dir={run}")).fit()
    assert (run / "samples" / "step_0000002.png").exists()
    out = tmp_path / "grid.png"
    result = run_cli("train.sample", str(run), "--steps", "3", "--per-class", "2", "--guidance", "2",
                        "--classes", "3", "7", "--out", str(out))
    assert result.returncode == 0, result.stderr
    from PIL import Image

    assert Image.open(out).size[0] > 64
    bad = run_cli("train.sample", str(tmp_path / "nothing"))
    assert bad.returncode == 2 and f"'{tmp_path / 'nothing'}' does not exist; pass runs/X" in bad.stderr
    (tmp_path / "nothing").mkdir()
    bad = run_cli("train.sample", str(tmp_path / "nothing"))
    assert bad.returncode == 2 and "neither a checkpoint folder nor a run folder" in bad.stderr
