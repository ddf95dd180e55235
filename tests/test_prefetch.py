"""Next-batch prefetch gives exactly the batches, and so the losses, of loading on demand."""

import gc
import weakref

import pytest

from train.data.prefetch import Prefetcher
from train.trainer import Trainer
from conftest import FAST, compose_cfg


def test_prefetched_batches_equal_on_demand_ones():
    calls = []

    def load(key):
        calls.append(key)
        step, start = key
        return [step, start], [step]

    prefetcher = Prefetcher(load, pin=False)
    assert prefetcher.get((0, 0), following=(0, 4)) == ([0, 0], [0])
    assert prefetcher.get((0, 4), following=(1, 0)) == ([0, 4], [0])  # served by the thread
    assert prefetcher.get((5, 0), following=None) == ([5, 0], [5])  # a jump (resume) loads on demand
    prefetcher.close()
    # (0, 4) was read once, ahead of time, and reused; the abandoned (1, 0) may or may not have run.
    assert calls.count((0, 4)) == 1 and calls.count((5, 0)) == 1


def test_a_prefetching_trainer_repeats_the_on_demand_losses(tmp_path):
    common = [*FAST, "trainer.max_steps=3", "trainer.batch_size=8", "trainer.grad_accum=2"]
    plain = Trainer(compose_cfg(*common, f"run_dir={tmp_path / 'plain'}")).fit()
    trainer = Trainer(compose_cfg(*common, f"run_dir={tmp_path / 'prefetch'}"))
    trainer.prefetcher = Prefetcher(trainer._load_batch, pin=False)  # the CUDA path, without pinning
    assert trainer.fit() == pytest.approx(plain, rel=0, abs=0)


def test_a_trainer_with_a_prefetcher_is_freed_when_dropped(tmp_path):
    """The trainer closes its prefetcher when collected (weakref.finalize, as on CUDA); the prefetcher must not hold
    the trainer, or its model, EMA and optimizer state stay on the GPU for the rest of the process (the GPU check
    runs a trainer and then other sections in one process)."""
    trainer = Trainer(compose_cfg(*FAST, "trainer.max_steps=1", f"run_dir={tmp_path / 'run'}"))
    trainer.prefetcher = Prefetcher(trainer._load_batch, pin=False)
    weakref.finalize(trainer, trainer.prefetcher.close)  # as train/trainer/setup.py does on CUDA
    trainer.fit()
    pool, alive = trainer.prefetcher.pool, weakref.ref(trainer)
    del trainer
    gc.collect()
    assert alive() is None and pool._shutdown  # freed, and its thread stopped
