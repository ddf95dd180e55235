"""Resume compares configs before it loads weights: every difference is refused (naming the key and the value trained
with), allowed with a warning, or allowed and printed (train/trainer/changes.py)."""

from __future__ import annotations

import pytest

from routing import ConfigError
from train.trainer import Trainer
from train.trainer.changes import classify
from conftest import FAST, compose_cfg, folder_hash, run_cli

ROUTE = {"selection_ratio": 0.75, "start_layer_idx": 2, "end_layer_idx": -3, "mode": "sprint", "path_drop": 0.1}


@pytest.fixture(scope="module")
def sprint_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("sprint") / "run"
    Trainer(compose_cfg(*FAST, "routing=sprint", "trainer.ckpt_every=2", "trainer.log_with=none", f"run_dir={run}")).fit()
    return run


def resume(run, *overrides):
    return Trainer(compose_cfg(*FAST, "trainer.ckpt_every=2", "trainer.log_with=none", f"run_dir={run}", "resume=true", *overrides))


@pytest.mark.parametrize("overrides, named", [
    (["routing=structured"], "routing.routes: the SPRINT route layout (start, end, mode) [(2, 5, 'sprint')]"),
    (["routing=none"], "[(2, 5, 'sprint')] -> []"),
    (["routing=sprint", "routing.policy=random"], "routing.policy: 'structured' -> 'random' (the SPRINT route's fusion layer"),
    (["routing=sprint", "routing.routes=[{selection_ratio: 0.75, start_layer_idx: 3, end_layer_idx: -3, mode: sprint, path_drop: 0.1}]"],
     "[(2, 5, 'sprint')] -> [(3, 5, 'sprint')]"),
], ids=["structured", "none", "policy", "moved"])
def test_a_change_that_moves_parameters_or_a_fusing_route_is_refused_before_any_weight_loads(sprint_run, overrides, named, monkeypatch):
    import train.trainer.resume as resume_module

    def never(*args, **kwargs):
        raise AssertionError("weights were loaded before the config check")

    monkeypatch.setattr(resume_module, "load_trained_state", never)
    before = folder_hash(sprint_run)
    with pytest.raises(ConfigError) as err:
        resume(sprint_run, *overrides)
    message = str(err.value)
    assert named in message and "does not fit this model: it was trained with other values of keys" in message and "\n" not in message
    assert folder_hash(sprint_run) == before


def test_a_changed_backbone_is_refused_naming_the_presets_value_trained_with(sprint_run):
    """The run was trained with backbone.depth null (dit-tiny's 8): the refusal names 8, never None, on one line, exit 2."""
    before = folder_hash(sprint_run)
    out = run_cli("train", *FAST, "routing=sprint", "trainer.ckpt_every=2", "trainer.log_with=none", f"run_dir={sprint_run}",
                  "resume=true", "backbone.depth=6")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "(differs in backbone.depth: 8 -> 6)" in out.stderr and "None" not in out.stderr
    assert folder_hash(sprint_run) == before


def test_the_same_route_and_backbone_written_another_way_are_no_change(sprint_run, capsys):
    """end_layer_idx 5 is -3 on depth 8, and backbone.depth=8 is the preset's depth: nothing is refused or printed."""
    route = "routing.routes=[{selection_ratio: 0.75, start_layer_idx: 2, end_layer_idx: 5, mode: sprint, path_drop: 0.1}]"
    trainer = resume(sprint_run, "routing=sprint", route, "backbone.depth=8", "backbone.hidden_size=128")
    out = capsys.readouterr().out
    assert trainer.step == 2 and "resume: applying" not in out and "warning" not in out
    trainer._release_run_dir()
    old = {"backbone": {"name": "dit", "preset": "tiny", "depth": None}, "routing": {"routes": [ROUTE]}, "align": {"layer": -7}}
    new = {"backbone": {"name": "dit", "preset": "tiny", "depth": 8}, "routing": {"routes": [{**ROUTE, "end_layer_idx": 5}]},
           "align": {"layer": 1}}
    assert classify(old, new) == classify(old, old)


def test_the_second_stage_and_the_learning_rate_are_applied_and_printed(sprint_run, capsys):
    trainer = resume(sprint_run, "routing=sprint_finetune", "trainer.lr=1e-4", "trainer.max_steps=3")
    out = capsys.readouterr().out
    assert "resume: applying changed settings:" in out and "warning" not in out
    assert "routing.routes[0].selection_ratio: 0.75 -> 0.0 (SPRINT's second stage" in out and "trainer.lr: 0.001 -> 0.0001" in out
    assert trainer.step == 2 and all(g["lr"] == 1e-4 for g in trainer.optimizer.param_groups)
    trainer._release_run_dir()


def test_a_tread_route_or_batch_change_resumes_with_a_warning(tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(compose_cfg(*FAST, "routing=random", "trainer.ckpt_every=2", "trainer.log_with=none", f"run_dir={run}")).fit()
    capsys.readouterr()
    trainer = resume(run, "routing=rows", "trainer.batch_size=2")
    out = capsys.readouterr().out
    assert "resume: warning: routing.policy: 'random' -> 'rows' (the weights continue under other routes" in out
    assert "resume: warning: trainer.batch_size: 4 -> 2 (each later step draws another share" in out
    assert trainer.step == 2
    trainer._release_run_dir()


def test_every_difference_lands_in_exactly_one_class():
    old = {"routing": {"policy": "structured", "routes": [ROUTE]}, "trainer": {"lr": 1e-3, "batch_size": 4, "max_steps": 2},
           "edm": {"P_mean": -1.2, "sigma_data": 0.5}, "seed": 0}
    new = {"routing": {"policy": "structured", "routes": [{**ROUTE, "selection_ratio": 0.0}]},
           "trainer": {"lr": 1e-4, "batch_size": 8, "max_steps": 9}, "edm": {"P_mean": -0.4, "sigma_data": 0.5}, "seed": 1}
    changes = classify(old, new)
    assert [c.split(":")[0] for c in changes.refused] == ["seed"]
    assert sorted(c.split(":")[0] for c in changes.warned) == ["edm.P_mean", "trainer.batch_size"]
    assert sorted(c.split(":")[0] for c in changes.applied) == ["routing.routes[0].selection_ratio", "trainer.lr", "trainer.max_steps"]


def test_a_policy_change_names_the_fusion_layer_the_way_it_goes():
    tread = {"routing": {"policy": "random", "routes": [{**ROUTE, "mode": "tread"}]}}
    sprint = {"routing": {"policy": "structured", "routes": [ROUTE]}}
    policy = lambda changes: next(c for c in changes.refused if c.startswith("routing.policy"))  # noqa: E731
    assert policy(classify(sprint, tread)).endswith("(the SPRINT route's fusion layer was trained on this policy's token layout)")
    assert policy(classify(tread, sprint)).endswith("(the checkpoint has no SPRINT route, whose fusion layer this config adds)")


def test_the_refusal_is_one_sentence_naming_parameter_keys_and_meaning_keys_apart():
    from train.trainer.changes import refusal

    message = refusal("runs/x/checkpoints/step_0000002", ["routing.policy: 'structured' -> 'random'", "seed: 0 -> 1"])
    assert message == ("checkpoint 'runs/x/checkpoints/step_0000002' does not fit this model: it was trained with other values of "
                       "keys that add, remove or move parameters (routing.policy: 'structured' -> 'random') and was trained with "
                       "other values of keys that cannot change on resume (seed: 0 -> 1); resume with the saved values or start "
                       "a new run_dir.")


def test_a_resume_command_naming_only_the_run_continues_it_as_it_was_started(tmp_path):
    """`python -m train run_dir=R resume=true` reads R's own overrides (.hydra/overrides.yaml) before its own: the run
    continues with its family, routes and batch, loss for loss as if it had not stopped; the command's keys still win."""
    import json

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    started = [*FAST, "backbone.depth=6", "routing=rows", "trainer.batch_size=6", "trainer.ckpt_every=2", "trainer.log_with=none"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_cli("train", *started, "trainer.max_steps=3", f"run_dir={straight}").returncode == 0
    assert run_cli("train", *started, f"run_dir={split}").returncode == 0
    resumed = run_cli("train", f"run_dir={split}", "resume=true", "trainer.max_steps=3")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resume: the run's own settings from {split / '.hydra' / 'overrides.yaml'}: " in resumed.stdout
    assert "routing=rows trainer.batch_size=6" in resumed.stdout and "trainer.max_steps=2" not in resumed.stdout
    assert losses(split) == losses(straight) and len(losses(straight)) == 3
    assert "trainer.batch_size=6" in (split / ".hydra" / "overrides.yaml").read_text()  # the next resume reads them again

    (split / ".hydra" / "overrides.yaml").write_text("backbone: [rwkv\n")
    refused = run_cli("train", f"run_dir={split}", "resume=true", "trainer.max_steps=4")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: '{split / '.hydra' / 'overrides.yaml'}' is not valid YAML; repeat the run's settings on the command line "
        "and restore or delete this file."]
    (split / ".hydra" / "overrides.yaml").write_text("- backbone=[rwkv\n")
    refused = run_cli("train", f"run_dir={split}", "resume=true", "trainer.max_steps=4")
    assert refused.returncode == 2 and "overrides.yaml' holds an override Hydra cannot parse; repeat" in refused.stderr


def test_a_resume_that_selects_another_data_option_drops_the_runs_keys_of_its_own(tmp_path):
    """Resuming another run's checkpoint with another data option: the run's data.* overrides belong to its own option
    (data=shapes' num_images) and are dropped, said so, instead of being refused as keys of the command's data=digits;
    then the checkpoint's own refusal (another data config) speaks."""
    other = tmp_path / "shapes"
    started = [*FAST, "data=shapes", "data.resolution=16", "data.num_images=64", "trainer.ckpt_every=2",
               "trainer.log_with=none"]
    assert run_cli("train", *started, f"run_dir={other}").returncode == 0
    checkpoint = other / "checkpoints" / "step_0000002"
    resumed = run_cli("train", *FAST, "data=digits", f"run_dir={tmp_path / 'digits'}", f"resume={checkpoint}")
    assert ("not data.resolution=16 data.num_images=64: keys of the run's data=shapes, which data=digits replaces"
            in resumed.stdout), resumed.stdout
    assert resumed.returncode == 2 and len(resumed.stderr.strip().splitlines()) == 1, resumed.stderr
    assert "was trained with a different data config" in resumed.stderr and "data.num_images" in resumed.stderr
    assert "is a key of" not in resumed.stderr and not (tmp_path / "digits").exists()
