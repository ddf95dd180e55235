"""Run folders never lose a checkpoint; the divergence guard; changed settings on resume; refused bad data."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

import train.checkpoint as checkpoint
from routing import ConfigError
from train.checkpoint import latest_checkpoint, load_checkpoint
from train.cli import RunStopped, friendly_errors
from train.data.latents import LatentDataset
from train.rundir import RunLock
from train.trainer import Trainer
from conftest import FAST, ROOT, compose_cfg, run_cli


def cfg(run: Path, *overrides: str):
    return compose_cfg(*FAST, f"run_dir={run}", *overrides)


def steps_in(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step_*"))


# Run folders.


def test_fresh_run_into_a_used_folder_is_refused_unless_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    Trainer(cfg(run, "trainer.ckpt_every=2")).fit()
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints up to step_0000002\); pass resume=auto"):
        Trainer(cfg(run, "trainer.ckpt_every=2"))
    assert steps_in(run) == ["step_0000002"]
    result = run_cli("train", *FAST, f"run_dir={run}")
    assert result.returncode == 2 and "already holds a run" in result.stderr and "Traceback" not in result.stderr
    # overwrite=true moves the old run aside; nothing is deleted and nothing mixes.
    Trainer(cfg(run, "trainer.ckpt_every=2", "overwrite=true")).fit()
    (old,) = tmp_path.glob("run.old-*")
    assert steps_in(old) == ["step_0000002"] and steps_in(run) == ["step_0000002"]
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_second_trainer_on_a_folder_in_use_is_refused(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "train", *FAST, "trainer.max_steps=100000", f"run_dir={run}"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.2)
        record = (run / ".hydra" / "overrides.yaml").read_text()
        second = run_cli("train", *FAST, f"run_dir={run}", "resume=auto")
        assert second.returncode == 2, second.stderr
        assert f"is in use by another trainer (pid {first.pid})" in second.stderr and "Traceback" not in second.stderr
        assert (run / ".hydra" / "overrides.yaml").read_text() == record  # the running trainer's record is its own
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The kernel dropped the killed trainer's lock: the folder is usable again.
    RunLock(run).release()


def test_a_kill_between_removal_and_rename_cannot_lose_the_latest_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "run"
    Trainer(cfg(run, "trainer.max_steps=4", "trainer.ckpt_every=2")).fit()
    before = load_file(run / "checkpoints" / "step_0000004" / "model.safetensors")
    # Re-saving step 4 (resume from the explicit step_2 checkpoint), killed right after the old step_4 moved aside.
    real_replace, calls = os.replace, []

    def killed_after_first_rename(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).name == "step_0000004" and ".replaced_step_0000004" in calls:
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    trainer = Trainer(cfg(run, "trainer.max_steps=4", "trainer.ckpt_every=2", f"resume={run / 'checkpoints' / 'step_0000002'}"))
    monkeypatch.setattr(checkpoint.os, "replace", killed_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    del trainer
    # `latest` still finds a complete checkpoint (the moved-aside copy), so resume=auto does not restart from 0.
    found = latest_checkpoint(run / "checkpoints")
    assert found is not None and load_checkpoint(found)["step"] == 4
    resumed = Trainer(cfg(run, "trainer.max_steps=6", "trainer.ckpt_every=2", "resume=auto"))
    assert resumed.step == 4
    assert steps_in(run) == ["step_0000002", "step_0000004"]  # restored in place
    assert not list((run / "checkpoints").glob(".*_step_*"))
    after = load_file(run / "checkpoints" / "step_0000004" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_interrupted_temporary_folders_are_removed_on_the_next_start(tmp_path):
    run = tmp_path / "run"
    Trainer(cfg(run, "trainer.ckpt_every=2")).fit()
    root = run / "checkpoints"
    (root / ".tmp_step_0000004_12345").mkdir()
    (root / ".tmp_step_0000004_12345" / "model.safetensors").write_bytes(b"x" * 1000)
    (root / ".latest.12345").write_text("step_0000004")
    Trainer(cfg(run, "resume=auto", "trainer.max_steps=3"))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000002"]


def test_rotation_never_deletes_the_checkpoint_latest_names(tmp_path):
    run = tmp_path / "run"
    Trainer(cfg(run, "trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.keep_checkpoints=3")).fit()
    # Continue from the older step 2 with keep 1: the new step 3 is kept, the newer-numbered step 4 goes.
    Trainer(cfg(run, "trainer.max_steps=3", "trainer.ckpt_every=3", "trainer.keep_checkpoints=1",
                f"resume={run / 'checkpoints' / 'step_0000002'}")).fit()
    assert steps_in(run) == ["step_0000003"]
    assert latest_checkpoint(run / "checkpoints").name == "step_0000003"


def test_preview_runs_after_the_save_of_its_step(tmp_path, monkeypatch):
    run = tmp_path / "run"
    trainer = Trainer(cfg(run, "trainer.ckpt_every=2", "trainer.sample_every=2"))
    monkeypatch.setattr(trainer, "sample_grid", lambda: (_ for _ in ()).throw(OSError("VAE gone")))
    with pytest.raises(OSError):
        trainer.fit()
    assert steps_in(run) == ["step_0000002"]


def test_read_only_run_dir_is_one_sentence(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() == 0:  # root writes into read-only folders: os.access answers as for anyone else
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: real(p, mode, **kw) and not (
            mode & os.W_OK and not os.stat(p).st_mode & 0o200))
    with pytest.raises(ConfigError, match="is not writable"):
        Trainer(cfg(ro / "run"))
    assert list(ro.iterdir()) == []


# Resume with changed settings.


def test_changed_settings_on_resume_are_applied_and_logged_or_refused(tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(cfg(run, "trainer.ckpt_every=2")).fit()
    trainer = Trainer(cfg(run, "trainer.ckpt_every=2", "resume=true", "trainer.lr=1e-4", "trainer.batch_size=2"))
    assert all(g["lr"] == 1e-4 for g in trainer.optimizer.param_groups)
    out = capsys.readouterr().out
    assert "trainer.lr: 0.001 -> 0.0001" in out and "trainer.batch_size: 4 -> 2" in out
    del trainer
    with pytest.raises(ConfigError, match=r"cannot change on resume \(edm.sigma_data: 0.5 -> 0.25\)"):
        Trainer(cfg(run, "resume=true", "edm.sigma_data=0.25"))


# The divergence guard.


def poison_from(trainer: Trainer, step: int) -> None:
    """From optimizer step `step` on, the data is NaN (so the loss and gradient are)."""
    real_get = trainer.dataset.get

    def get(indices, generator):
        x, labels = real_get(indices, generator)
        return (x * float("nan") if trainer.step >= step else x), labels

    trainer.dataset.get = get


def test_divergence_skips_steps_stops_and_names_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(cfg(run, "trainer.max_steps=20", "trainer.ckpt_every=2", "trainer.max_bad_steps=3", "trainer.keep_checkpoints=1"))
    poison_from(trainer, 5)  # steps 6, 7, 8 are non-finite
    with pytest.raises(RunStopped, match=r"3 steps in a row \(up to step 8\).*the last good checkpoint is .*step_0000004"):
        trainer.fit()
    ema_after = {k: v.clone() for k, v in trainer.ema.module.state_dict().items()}
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 8 and lines[-1]["skipped_steps"] == 3 and lines[4]["skipped_steps"] == 0
    # No checkpoint came from the bad steps (step 6's save was skipped), and the good one loads.
    assert steps_in(run) == ["step_0000004"]
    state = load_checkpoint(run / "checkpoints" / "step_0000004")
    assert not checkpoint.non_finite(state["model"]) and not checkpoint.non_finite(state["ema"])
    assert all(torch.isfinite(v).all() for v in ema_after.values())
    del trainer
    # resume=auto continues from it.
    resumed = Trainer(cfg(run, "trainer.max_steps=6", "trainer.ckpt_every=2", "resume=auto"))
    assert resumed.step == 4
    losses = resumed.fit()
    assert len(losses) == 2 and all(np.isfinite(losses))


@pytest.mark.parametrize("grad_clip", ["null", "1.0"])  # with clipping the guard reads the norm the clip measured
def test_a_single_bad_step_is_skipped_without_touching_weights_or_ema(tmp_path, grad_clip):
    trainer = Trainer(cfg(tmp_path / "run", "trainer.max_steps=3", f"trainer.grad_clip={grad_clip}"))
    poison_from(trainer, 1)
    trainer.train_step()  # step 1: fine
    weights = {k: v.clone() for k, v in trainer.net.state_dict().items()}
    ema = {k: v.clone() for k, v in trainer.ema.module.state_dict().items()}
    trainer.train_step()  # step 2: NaN
    assert trainer.skipped_steps == 1 and trainer.bad_streak == 1
    assert all(torch.equal(weights[k], v) for k, v in trainer.net.state_dict().items())
    assert all(torch.equal(ema[k], v) for k, v in trainer.ema.module.state_dict().items())


def test_stopped_run_exits_non_zero_in_one_line(capsys):
    @friendly_errors
    def diverge():
        raise RunStopped("training diverged: ...")

    with pytest.raises(SystemExit) as exit_:
        diverge()
    assert exit_.value.code == 3 and capsys.readouterr().err == "error: training diverged: ...\n"


def test_checkpoints_with_non_finite_or_corrupted_tensors_are_refused(tmp_path):
    run = tmp_path / "run"
    Trainer(cfg(run, "trainer.ckpt_every=2")).fit()
    ckpt = run / "checkpoints" / "step_0000002"
    # Bytes flipped inside the tensor data, header intact: the checksum catches it.
    raw = bytearray((ckpt / "model.safetensors").read_bytes())
    raw[-8:] = b"\xff" * 8
    (ckpt / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="corrupted \\(model.safetensors does not match the checksum"):
        Trainer(cfg(run, "resume=true"))
    # A NaN tensor in a checkpoint without checksums (older format) is refused too.
    weights = load_file(ckpt / "ema.safetensors")
    weights[next(iter(weights))][..., 0] = float("nan")
    save_file(weights, ckpt / "ema.safetensors")
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({"step": state["step"]}))
    (ckpt / "model.safetensors").write_bytes(bytes(raw[:-8]) + b"\x00" * 8)
    with pytest.raises(ConfigError, match="holds NaN or inf in ema.safetensors"):
        load_checkpoint(ckpt)


# Data checks.


def write_latents(folder: Path, mean: np.ndarray, labels: np.ndarray, std: list[float]) -> Path:
    folder.mkdir()
    save_numpy({"mean": mean.astype(np.float32), "std": np.full_like(mean, 0.1, dtype=np.float32), "labels": labels.astype(np.int64)},
               folder / "shard-00000.safetensors")
    meta = {"complete": True, "num_classes": 2, "class_names": ["a", "b"], "latent_shape": list(mean.shape[1:]),
            "scaling_factor": 0.18215, "vae": "none", "shards": [{"file": "shard-00000.safetensors", "count": len(mean)}]}
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "stats.json").write_text(json.dumps({"mean": [0.0] * mean.shape[1], "std": std}))
    return folder


@pytest.mark.parametrize(
    "case, message",
    [("nan", "hold NaN or inf latents"), ("zero_std", "non-finite or zero channel std"), ("label", "labels in \\[0, 7\\] outside the 2 classes")],
)
def test_bad_latents_are_refused_in_one_sentence(case, message, tmp_path):
    mean = np.random.default_rng(0).normal(size=(6, 2, 4, 4))
    labels = np.array([0, 1, 0, 1, 0, 7 if case == "label" else 1])
    if case == "nan":
        mean[3, 0, 0, 0] = np.nan
    folder = write_latents(tmp_path / "lat", mean, labels, [0.0, 1.0] if case == "zero_std" else [1.0, 1.0])
    with pytest.raises(ConfigError, match=message) as err:
        LatentDataset(folder, "standardize", 0.5).get(torch.arange(6), torch.Generator())
    assert "data.path=" in str(err.value) and "\n" not in str(err.value)
