"""The divergence guard for exploding but finite weights: a checkpoint whose weight norm jumped far beyond the
run's recent history is never saved, the run stops naming the newest checkpoint that passed, healthy runs of
every family never trip it, and trainer.max_weight_growth widens it."""

import numpy as np
import pytest
import torch

from train.checkpoint import load_checkpoint
from train.cli import RunStopped, friendly_errors
from train.trainer import Trainer
from conftest import FAST, compose_cfg

TINY = ["backbone.depth=2", "backbone.hidden_size=32"]
DEFAULT_GROWTH = 10.0  # configs/config.yaml


def cfg(run, *overrides):
    return compose_cfg(*FAST, *TINY, f"run_dir={run}", *overrides)


def steps_in(run):
    return sorted(p.name for p in (run / "checkpoints").glob("step_*"))


FAMILIES = ["dit", "rwkv", "mamba", "diffmoe"]
LONG = [pytest.param(family, 300, "trainer.batch_size=16", marks=pytest.mark.slow, id=f"{family}-300-steps") for family in FAMILIES]


@pytest.mark.parametrize("family, steps, batch", [*((f, 8, "trainer.batch_size=4") for f in FAMILIES), *LONG])
def test_healthy_runs_of_every_family_never_trip_it(family, steps, batch, tmp_path):
    run = tmp_path / "run"
    every = steps // 4
    trainer = Trainer(cfg(run, f"backbone={family}", batch, f"trainer.max_steps={steps}", f"trainer.ckpt_every={every}",
                          "trainer.keep_checkpoints=1"))
    assert trainer.cfg.trainer.max_weight_growth == DEFAULT_GROWTH
    losses = trainer.fit()
    assert all(np.isfinite(losses)) and steps_in(run) == [f"step_{steps:07d}"]
    norms = [norm for _, norm in trainer.norms]
    assert len(norms) == 5  # the start and four checkpoints, each passed
    # A healthy run moves its weight norm by a few percent, far from the factor the guard allows.
    growth = max(norms[i] / max(norms[max(0, i - 5):i]) for i in range(1, len(norms)))
    assert growth < 1.5 < DEFAULT_GROWTH


def exploding_at(trainer: Trainer, step: int, factor: float) -> None:
    """After optimizer step `step`, the weights are `factor` times larger but finite (as with a huge weight decay)."""
    real_step = trainer.train_step

    def train_step():
        loss = real_step()
        if trainer.step == step:
            with torch.no_grad():
                for p in trainer.net.parameters():
                    p.mul_(factor)
        return loss

    trainer.train_step = train_step


def test_exploding_weights_are_not_saved_and_the_newest_passing_checkpoint_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    trainer = Trainer(cfg(run, "trainer.max_steps=8", "trainer.ckpt_every=2", "trainer.keep_checkpoints=1"))
    exploding_at(trainer, 6, 100.0)
    with pytest.raises(SystemExit) as exit_:
        friendly_errors(trainer.fit)()
    err = capsys.readouterr().err
    (message,) = [line for line in err.splitlines() if line.startswith("error:")]  # one sentence after the progress bar
    assert exit_.value.code == 3 and "Traceback" not in err
    assert "the weights' norm at step 6" in message and "trainer.max_weight_growth=10" in message
    assert f"the last good checkpoint is {run / 'checkpoints' / 'step_0000004'}" in message
    # The exploded checkpoint was never written, so with keep_checkpoints=1 it rotated out nothing.
    assert steps_in(run) == ["step_0000004"] and (run / "checkpoints" / "latest").read_text() == "step_0000004"
    del trainer
    # Continuing from it, as the message advises, trains on.
    resumed = Trainer(cfg(run, "trainer.max_steps=6", "trainer.ckpt_every=2", "resume=auto", "trainer.lr=1e-4"))
    assert resumed.step == 4 and all(np.isfinite(resumed.fit()))
    assert load_checkpoint(run / "checkpoints" / "step_0000006")["step"] == 6


@pytest.mark.parametrize("growth", ["1000", "null"])
def test_a_key_widens_or_turns_off_the_check(growth, tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(cfg(run, "trainer.max_steps=4", "trainer.ckpt_every=2", f"trainer.max_weight_growth={growth}"))
    exploding_at(trainer, 4, 100.0)
    trainer.fit()
    assert steps_in(run) == ["step_0000002", "step_0000004"]


def test_non_finite_weights_stop_the_run_naming_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(cfg(run, "trainer.max_steps=6", "trainer.ckpt_every=2", "trainer.max_weight_growth=null"))
    exploding_at(trainer, 4, float("inf"))
    with pytest.raises(RunStopped, match=r"weights hold NaN or inf .*the last good checkpoint is .*step_0000002"):
        trainer.fit()
    assert steps_in(run) == ["step_0000002"]
