"""Resuming what an older version wrote, or a damaged file of a checkpoint: one sentence naming the key or the file.

- A checkpoint of an align=self run from before align.head existed built REPA's projector: its config has no head,
  which reads as repa (train/schema/check.py, `_align_as_built`), so today's align=self (SRA's head) is refused naming
  `align.head: 'repa' -> 'sra'`, and align.head=repa resumes it.
- optimizer.pt damaged (random bytes, or another object saved under its name) is named, as the safetensors files are.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from routing import ConfigError
from train.trainer import Trainer
from conftest import FAST, compose_cfg, folder_hash

TINY = ["backbone.depth=4", "backbone.hidden_size=32", "trainer.log_with=none", "trainer.ckpt_every=2"]
OLD_SELF = ["align=self", "align.head=repa", "align.projector_width=16"]  # what align=self built before align.head
CKPT = "checkpoints/step_0000002"


@pytest.fixture(scope="module")
def old_self_run(tmp_path_factory):
    """An align=self run at step 2 whose checkpoint config, as one written before align.head existed, has no head."""
    run = tmp_path_factory.mktemp("old_self") / "run"
    Trainer(compose_cfg(*FAST, *TINY, *OLD_SELF, f"run_dir={run}")).fit()
    config = run / CKPT / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    del saved["align"]["head"]
    config.write_text(yaml.safe_dump(saved))
    return run


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def resume(run, *overrides):
    return Trainer(compose_cfg(*FAST, *TINY, "trainer.max_steps=3", f"run_dir={run}", "resume=true", *overrides))


def test_an_old_self_alignment_checkpoint_without_a_head_is_refused_naming_the_head_it_built(old_self_run, tmp_path):
    run = copy_of(old_self_run, tmp_path)
    before = folder_hash(run)
    with pytest.raises(ConfigError) as err:
        resume(run, "align=self", "align.projector_width=16")  # today's align=self: SRA's head
    message = str(err.value)
    assert "align.head: 'repa' -> 'sra'" in message and "\n" not in message, message
    assert "None" not in message, message
    assert folder_hash(run) == before


def test_an_old_self_alignment_checkpoint_resumes_with_the_head_it_built(old_self_run, tmp_path):
    run = copy_of(old_self_run, tmp_path)
    trainer = resume(run, *OLD_SELF)
    assert trainer.step == 2
    trainer._release_run_dir()


def test_null_alignment_settings_compare_as_the_values_they_build(old_self_run, tmp_path):
    """The run was trained with align.layer and teacher_layer null (SRA's blocks, 1 and 2 at depth 4): the same blocks
    written out are no change; a null head width is the head's own (repa's 2048), named so, never as None."""
    run = copy_of(old_self_run, tmp_path)
    trainer = resume(run, *OLD_SELF, "align.layer=1", "align.teacher_layer=2")
    assert trainer.step == 2
    trainer._release_run_dir()
    with pytest.raises(ConfigError) as err:
        resume(run, *OLD_SELF[:2], "align.projector_width=null")
    assert "align.projector_width: 16 -> 2048" in str(err.value) and "None" not in str(err.value), str(err.value)


@pytest.mark.parametrize("damage, problem", [
    (lambda path: path.write_bytes(b"garbage" * 10), "is not a readable PyTorch file"),
    (lambda path: torch.save([1, 2, 3], path), "holds no optimizer and no torch_rng state"),
    (lambda path: path.write_bytes(path.read_bytes()[:100]), "is not a readable PyTorch file"),
], ids=["garbage", "a_list", "truncated"])
def test_a_damaged_optimizer_file_is_named(old_self_run, tmp_path, damage, problem):
    run = copy_of(old_self_run, tmp_path)
    path = run / CKPT / "optimizer.pt"
    damage(path)
    before = folder_hash(run)
    with pytest.raises(ConfigError) as err:
        resume(run, *OLD_SELF)
    message = str(err.value)
    assert message.startswith(f"'{path}' {problem}") and message.endswith("; resume from an older step_* folder.") and "\n" not in message, message
    assert folder_hash(run) == before
