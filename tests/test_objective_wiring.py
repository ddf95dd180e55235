"""The objective, routed inference, routing guidance and MoE capacity, wired through the trainer and the commands."""

import json
import re
from pathlib import Path

import pytest

from routing import ConfigError
from train.trainer import Trainer
from conftest import FAST, compose_cfg, run_cli


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_flow_resume_repeats_an_uninterrupted_run(tmp_path):
    common = [*FAST, "objective=flow", "routing=random", "trainer.batch_size=8", "trainer.ckpt_every=3"]
    Trainer(compose_cfg(*common, "trainer.max_steps=6", f"run_dir={tmp_path / 'straight'}")).fit()
    Trainer(compose_cfg(*common, "trainer.max_steps=3", f"run_dir={tmp_path / 'split'}")).fit()
    Trainer(compose_cfg(*common, "trainer.max_steps=6", f"run_dir={tmp_path / 'split'}", "resume=true")).fit()
    straight, split = metrics(tmp_path / "straight"), metrics(tmp_path / "split")
    assert [m["step"] for m in split] == list(range(1, 7))
    for a, b in zip(straight, split):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6), a["step"]


def test_a_checkpoint_refuses_the_other_objective(tmp_path):
    run = tmp_path / "run"
    Trainer(compose_cfg(*FAST, "trainer.ckpt_every=2", f"run_dir={run}")).fit()
    with pytest.raises(ConfigError, match=r"different objective config"):
        Trainer(compose_cfg(*FAST, f"run_dir={run}", "resume=true", "objective=flow"))
    refused = run_cli("train.sample", str(run), "--objective", "flow", "--steps", "2", "--per-class", "1")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "trained with objective=edm" in refused.stderr


def test_routed_inference_and_routing_guidance_sample_a_flow_model(tmp_path):
    run = tmp_path / "run"
    Trainer(compose_cfg(*FAST, "objective=flow", "routing=random", "trainer.ckpt_every=2", f"run_dir={run}")).fit()
    routed = run_cli("train.sample", str(run), "--objective", "flow", "--steps", "2", "--per-class", "1",
                        "--route-ratio", "0.5", "--out", str(tmp_path / "routed.png"))
    assert routed.returncode == 0, routed.stderr
    # Forcing half the tokens past the route makes each evaluation cheaper than the unrouted network.
    ratio = float(re.search(r"the unguided network [0-9.]+ G \(([0-9.]+)x\)", routed.stdout).group(1))
    assert ratio < 1.0
    guided = run_cli("train.sample", str(run), "--steps", "2", "--per-class", "1", "--rg-scale", "2",
                        "--rg-gamma1", "0.2", "--rg-gamma2", "0.6", "--out", str(tmp_path / "guided.png"))
    assert guided.returncode == 0, guided.stderr
    # Two branches, each routed: more than one unrouted evaluation, less than two.
    ratio = float(re.search(r"the unguided network [0-9.]+ G \(([0-9.]+)x\)", guided.stdout).group(1))
    assert 1.0 < ratio < 2.0
    assert (tmp_path / "routed.png").exists() and (tmp_path / "guided.png").exists()


def test_diffmoe_trains_with_logged_auxiliary_losses_and_samples_at_a_capacity_target(tmp_path):
    run = tmp_path / "run"
    Trainer(compose_cfg(*FAST, "backbone=diffmoe", "trainer.ckpt_every=2", f"run_dir={run}")).fit()
    logged = metrics(run)[-1]
    assert logged["moe_capacity_predictor"] > 0
    result = run_cli("train.sample", str(run), "--steps", "2", "--per-class", "1", "--moe-target", "1.0",
                        "--out", str(tmp_path / "moe.png"))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", ["train.sample", "train.fid"])
@pytest.mark.parametrize("flags, named", [
    (["--route-ratio", "1.5"], "--route-ratio"),
    (["--rg-scale", "2", "--rg-gamma1", "0.8", "--rg-gamma2", "0.3"], "--rg-gamma1"),
    (["--rg-gamma2", "abc"], "--rg-gamma2"),
    (["--moe-threshold", "0.5", "--moe-target", "1"], "--moe-target"),
    (["--moe-target", "-1"], "--moe-target"),
])
def test_sampling_rule_flags_are_refused_in_one_sentence(command, flags, named, capsys, tmp_path):
    import importlib

    parse_args = importlib.import_module(command).parse_args
    positional = ["runs/x"] if command == "train.sample" else ["--images", str(tmp_path), "--ref", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*positional, *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err and "Traceback" not in err
