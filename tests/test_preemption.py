"""Preemption: SIGTERM, SIGUSR1 and Ctrl-C save the step in flight, name the checkpoint in one line and exit with
128 + the signal; the run continues from it as if it had never stopped."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from train import checkpoint
from train.cli import Preempted
from train.files import read_state
from train.trainer import Trainer
from conftest import FAST, ROOT, compose_cfg
from test_resume_and_distributed import losses

COMMON = [*FAST, "routing=random", "trainer.batch_size=8", "trainer.log_every=3", "trainer.ckpt_every=50"]


def sigterm_a_process(run):
    """`python -m train` into `run`, sent SIGTERM once it logged two steps (past step 6, long before the first checkpoint
    at step 50): checks its one line and exit code 143, and returns the step it saved."""
    proc = subprocess.Popen([sys.executable, "-m", "train", *COMMON, "trainer.max_steps=100000", f"run_dir={run}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 600  # a loaded 2-core machine can take minutes to start a run
    metrics = run / "metrics.jsonl"

    def logged() -> bool:
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 2

    while time.time() < deadline and proc.poll() is None and not logged():
        time.sleep(0.1)
    assert proc.poll() is None and logged(), "the run had not logged two steps when the signal was due"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("train:")]  # less the bar
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    step = read_state(checkpoint.latest_checkpoint(run / "checkpoints")).step
    assert 6 <= step < 50
    ckpt = run / "checkpoints" / f"step_{step:07d}"
    assert lines[0] == (f"SIGTERM at step {step}: saved checkpoint {ckpt}; continue with python -m train run_dir={run} "
                        f"resume=auto (exit code 143).")
    return step


def assert_same_run(run, straight, end: int) -> None:
    """Equal losses at every logged step, and bit-identical weights and EMA at step `end`."""
    assert losses(run) == losses(straight)
    name = f"step_{end:07d}"
    for weights in ("model.safetensors", "ema.safetensors"):
        got, want = load_file(run / "checkpoints" / name / weights), load_file(straight / "checkpoints" / name / weights)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), weights


def test_sigterm_between_checkpoints_saves_the_step_in_one_line(tmp_path):
    # The real process and signal; that the run then continues bit-identically is checked in-process below (and, all
    # three runs as processes, under -m slow), which costs no further interpreter start-ups.
    sigterm_a_process(tmp_path / "preempted")


@pytest.mark.slow
def test_sigterm_between_checkpoints_saves_the_step_and_resumes_bit_identically(tmp_path):
    run = tmp_path / "preempted"
    step = sigterm_a_process(run)
    # Continued with resume=auto to a few steps on, it matches a run that was never stopped: losses and weights. Both run
    # as processes like the preempted one (same threads, no state left by other tests in this worker), so bit for bit
    # compares the resume, not two ways of running.
    end = step + 4
    straight = tmp_path / "straight"
    for args in ([f"run_dir={run}", "resume=auto"], [f"run_dir={straight}"]):
        subprocess.run([sys.executable, "-m", "train", *COMMON, f"trainer.max_steps={end}", *args], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_same_run(run, straight, end)


def _signal_at(trainer: Trainer, at: int, signum: int):
    """Make `trainer` receive `signum` while it runs step `at` (as a signal arriving mid-step would)."""
    step = trainer._step

    def signalled():
        step()
        if trainer.step == at:
            os.kill(os.getpid(), signum)

    trainer._step = signalled


def test_ctrl_c_mid_run_saves_and_a_second_signal_during_the_save_changes_nothing(tmp_path, monkeypatch):
    run = tmp_path / "run"
    trainer = Trainer(compose_cfg(*COMMON, "trainer.max_steps=20", f"run_dir={run}"))
    _signal_at(trainer, 4, signal.SIGINT)
    handler = signal.getsignal(signal.SIGINT)  # Python's default_int_handler; SIG_IGN under a shell's background job
    save = checkpoint.save_checkpoint

    def interrupted_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal (a second Ctrl-C, a SIGTERM) while the save runs
        return save(*args, **kwargs)

    monkeypatch.setattr("train.trainer.loop.save_checkpoint", interrupted_save)
    with pytest.raises(Preempted) as stopped:
        trainer.fit()
    assert stopped.value.code == 130
    assert str(stopped.value).startswith("SIGINT at step 4: saved checkpoint ")
    ckpt = checkpoint.latest_checkpoint(run / "checkpoints")
    assert ckpt.name == "step_0000004" and read_state(ckpt).step == 4
    checkpoint.load_checkpoint(ckpt)  # whole: every file's digest matches
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_0000004"]
    assert signal.getsignal(signal.SIGINT) is handler  # the handlers are put back


def test_a_run_stopped_by_sigterm_resumes_bit_identically(tmp_path):
    """The preempted, the resumed and the uninterrupted runs all in this process (the same threads and state for each),
    so bit for bit compares the resume; the slow test above runs the three as processes."""
    run, straight = tmp_path / "preempted", tmp_path / "straight"
    trainer = Trainer(compose_cfg(*COMMON, "trainer.max_steps=100000", f"run_dir={run}"))
    _signal_at(trainer, 7, signal.SIGTERM)  # between checkpoints (step 50) and between logging steps (every 3)
    with pytest.raises(Preempted, match=r"^SIGTERM at step 7: saved checkpoint "):
        trainer.fit()
    end = 7 + 4
    Trainer(compose_cfg(*COMMON, f"trainer.max_steps={end}", f"run_dir={run}", "resume=auto")).fit()
    Trainer(compose_cfg(*COMMON, f"trainer.max_steps={end}", f"run_dir={straight}")).fit()
    assert_same_run(run, straight, end)


def test_a_signal_at_a_checkpoint_step_saves_it_once(tmp_path, monkeypatch):
    run = tmp_path / "run"
    trainer = Trainer(compose_cfg(*COMMON, "trainer.max_steps=20", "trainer.ckpt_every=3", f"run_dir={run}"))
    _signal_at(trainer, 3, signal.SIGUSR1)
    saves = []
    save = checkpoint.save_checkpoint
    monkeypatch.setattr("train.trainer.loop.save_checkpoint", lambda *a, **k: saves.append(a[1]) or save(*a, **k))
    with pytest.raises(Preempted, match=r"^SIGUSR1 at step 3: saved checkpoint .*step_0000003.*\(exit code 138\)\.$"):
        trainer.fit()
    assert saves == [3]


@pytest.mark.slow
def test_two_processes_agree_on_the_step_they_save(tmp_path):
    """Under accelerate launch (gloo on CPU) SIGTERM reaches the launcher, which passes it to both processes at their
    own moments; they compare flags at the next reading step and save that same step once."""
    run = tmp_path / "two"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29563",
              "-m", "train", *COMMON, "trainer.max_steps=100000", f"run_dir={run}"]
    proc = subprocess.Popen(launch, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics, deadline = run / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    saved = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("SIGTERM at step ")]
    assert len(saved) == 1, err[-3000:]  # rank 0's line only
    step = read_state(checkpoint.latest_checkpoint(run / "checkpoints")).step
    assert step % 3 == 0 and f"SIGTERM at step {step}: saved checkpoint" in saved[0]  # a reading step (log_every=3)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", f"step_{step:07d}"]
