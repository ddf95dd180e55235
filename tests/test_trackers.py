"""trainer.log_with: metrics go to accelerate's trackers (TensorBoard, wandb offline) beside metrics.jsonl, which stays."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from routing import ConfigError
from train.schema import check_config
from train.trainer import Trainer


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for events in folder.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    return found


def test_tensorboard_through_accelerate_gets_what_metrics_jsonl_gets(cfg_factory):
    cfg = cfg_factory("trainer.max_steps=3")
    assert cfg.trainer.log_with == "tensorboard"  # the default, as runs logged before the key existed
    Trainer(cfg).fit()
    run = Path(cfg.run_dir)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = scalars(run / "tb")
    assert [(d["step"], pytest.approx(d["loss"])) for d in lines] == logged["loss"] and len(lines) == 3


def test_wandb_offline_writes_a_run_folder_with_the_metrics_and_the_config(cfg_factory, tmp_path, monkeypatch):
    import wandb  # a dev dependency (pyproject.toml), so this runs wherever the tests do

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")  # no system-metrics sampler for a two-step run
    Trainer(cfg_factory("trainer.log_with=wandb", "trainer.max_steps=2")).fit()
    assert wandb.run is None  # finished with the training
    wandb.teardown()  # what exiting the process does: wait for wandb's service to write the run's records out
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    records = list(runs[0].glob("run-*.wandb"))
    assert len(records) == 1
    # The run's records (protobuf) hold the logged keys and the flat config as plain strings.
    data = records[0].read_bytes()
    assert b"loss" in data and b"images_per_s" in data and b"trainer.lr" in data
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2  # metrics.jsonl stays


def test_log_with_none_keeps_metrics_jsonl_only(cfg_factory, tmp_path):
    Trainer(cfg_factory("trainer.log_with=none", "trainer.max_steps=1")).fit()
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and not (tmp_path / "run" / "tb").exists()


@pytest.mark.parametrize("value, message", [
    ("mlflw", "trainer.log_with='mlflw' is unknown; choose none or one or more of tensorboard, wandb"),
    ("[tensorboard,3]", "is neither a tracker name nor a list of them"),
])
def test_bad_trackers_are_refused(cfg_factory, value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        check_config(cfg_factory(f"trainer.log_with={value}"))


def test_a_tracker_whose_package_is_missing_names_the_install(cfg_factory, monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
    with pytest.raises(ConfigError, match=r"trainer.log_with=wandb needs the wandb package; `pip install wandb`"):
        check_config(cfg_factory("trainer.log_with=[tensorboard,wandb]"))
