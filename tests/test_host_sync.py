"""The training step makes no host read between logging steps: the divergence guard decides on the device, and the
losses and the guard's counts are read at logging steps only (train/trainer/step.py, guard.py).

Every read is recorded while the step runs (tests/host_reads.py: the aten ops that read a value or take a data-dependent
shape, and the Python methods item, tolist, bool, ...), except inside the data read (host work by design: on CUDA a
thread reads the next batch meanwhile). The model side of the step over every family, recipe, alignment and mask is
tests/test_host_reads_matrix.py's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from host_reads import HostReads
from train.trainer import Trainer
from conftest import FAST, compose_cfg


def while_recorded(trainer: Trainer, reads: HostReads) -> list:
    """Record the host reads of every step, the data read excepted; returns the steps run so."""
    steps, real_step, real_load = [], trainer._step, trainer._load_batch

    def step():
        reads.armed = True
        try:
            real_step()
        finally:
            reads.armed = False
        steps.append(trainer.step)

    def load(key):
        with reads.paused():
            return real_load(key)

    trainer._step, trainer._load_batch = step, load
    return steps


@pytest.mark.parametrize("extra", [["routing=random"], ["routing=random", "trainer.grad_accum=2", "trainer.grad_clip=1.0"]],
                         ids=["route", "accum-clip"])
def test_steps_between_logging_steps_read_nothing_on_the_host(tmp_path, extra):
    run = tmp_path / "run"
    trainer = Trainer(compose_cfg(*FAST, "trainer.max_steps=4", "trainer.log_every=4", "trainer.log_with=none", f"run_dir={run}", *extra))
    with HostReads() as reads:
        bool(torch.isfinite(torch.ones(())))  # the recorder bites: a read of the old step's kind is recorded
        assert [what for what, _ in reads.reads] == ["Tensor.__bool__"]
        reads.armed, reads.reads = False, []
        steps = while_recorded(trainer, reads)
        losses = trainer.fit()
    assert steps == [1, 2, 3, 4] and not reads.reads, reads.summary()
    # The losses of all four steps were read at once, at the logging step, and equal a run that reads every step.
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [4] and lines[0]["loss"] == losses[-1] and lines[0]["skipped_steps"] == 0
    reference = Trainer(compose_cfg(*FAST, "trainer.max_steps=4", "trainer.log_every=1", "trainer.log_with=none",
                                    f"run_dir={tmp_path / 'every'}", *extra)).fit()
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses == reference


def test_a_non_finite_step_is_skipped_on_the_device_and_counted_at_the_next_read(tmp_path):
    """Step 2's data is NaN: weights, AdamW state and EMA stay as step 1 left them without a host read; the read at
    step 3 finds one skipped step."""
    trainer = Trainer(compose_cfg(*FAST, "trainer.max_steps=3", "trainer.log_every=3", "trainer.log_with=none",
                                  f"run_dir={tmp_path / 'run'}", "routing=random"))
    real_get = trainer.dataset.get
    trainer.dataset.get = lambda idx, g: (lambda x, y: (x * float("nan") if trainer.step == 1 else x, y))(*real_get(idx, g))
    trainer.in_loop = True  # as inside fit: steps 1 and 2 are not read
    with HostReads(armed=False) as reads:
        while_recorded(trainer, reads)
        assert trainer.train_step() is None
        weights = {k: v.clone() for k, v in trainer.net.state_dict().items()}
        ema = {k: v.clone() for k, v in trainer.ema.module.state_dict().items()}
        adam = [s["exp_avg_sq"].clone() for s in trainer.optimizer.state.values()]
        assert trainer.train_step() is None  # the NaN step
    assert not reads.reads, reads.summary()
    assert all(torch.equal(weights[k], v) for k, v in trainer.net.state_dict().items())
    assert all(torch.equal(ema[k], v) for k, v in trainer.ema.module.state_dict().items())
    assert all(torch.equal(a, s["exp_avg_sq"]) for a, s in zip(adam, trainer.optimizer.state.values()))
    assert trainer.skipped_steps == 0  # not read yet
    loss = trainer.train_step()  # step 3 reads
    assert np.isfinite(loss) and trainer.skipped_steps == 1 and trainer.bad_streak == 0
    assert not np.isfinite(trainer.read_losses[1])


def test_max_bad_steps_stops_the_run_at_the_read_that_finds_them(tmp_path):
    """Steps 2 on are NaN, trainer.max_bad_steps=2: the read at step 4 (log_every=4) finds 3 in a row and stops there."""
    from train.cli import RunStopped

    trainer = Trainer(compose_cfg(*FAST, "trainer.max_steps=8", "trainer.log_every=4", "trainer.max_bad_steps=2",
                                  "trainer.log_with=none", f"run_dir={tmp_path / 'run'}"))
    real_get = trainer.dataset.get
    trainer.dataset.get = lambda idx, g: (lambda x, y: (x * float("nan") if trainer.step >= 1 else x, y))(*real_get(idx, g))
    with pytest.raises(RunStopped, match=r"3 steps in a row \(up to step 4\)"):
        trainer.fit()
    assert trainer.step == 4 and trainer.skipped_steps == 3
