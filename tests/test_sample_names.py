"""`python -m train.sample` never overwrites by default: the default grid name carries every option that changes the
samples, an existing file is kept unless --overwrite, the last line names the rule, and banners name the recipe."""

from __future__ import annotations

import pytest

from conftest import FAST, compose_cfg, run_cli
from train.sample import default_name, parse_args

# Each differs from the plain command in one option that changes the samples.
VARIANTS = [[], ["--guidance", "2"], ["--pdg-scale", "2"], ["--rg-scale", "2"], ["--rg-scale", "2", "--rg-gamma2", "0.7"],
            ["--rg-scale", "2", "--rg-gamma1", "0.1"], ["--rg-scale", "2", "--rg-uncond"], ["--rg-scale", "2", "--rg-bad", "runs/b"],
            ["--route-ratio", "0.5"], ["--steps", "3"], ["--sampler", "euler"], ["--seed", "1"], ["--per-class", "2"],
            ["--classes", "1", "2"], ["--prompt", "a red disk"], ["--prompt", "a blue disk"], ["--size", "32x16"],
            ["--flux-guidance", "3"], ["--moe-target", "1"], ["--moe-threshold", "0.5"]]


def test_every_option_that_changes_the_samples_changes_the_default_name():
    names = [default_name(parse_args(["runs/x", *variant])) for variant in VARIANTS]
    assert len(set(names)) == len(VARIANTS), names
    assert names[0] == "samples_cfg1_heun40_seed0_n8.png" and names[2] == "samples_pdg2_heun40_seed0_n8.png"
    # Options that do not change the samples keep the name.
    assert default_name(parse_args(["runs/x", "--objective", "edm", "--device", "cpu"])) == names[0]


@pytest.fixture(scope="module")
def sprint_run(tmp_path_factory):
    from train.trainer import Trainer

    run = tmp_path_factory.mktemp("sprint") / "run"
    Trainer(compose_cfg(*FAST, "backbone=dit", "routing=sprint", "trainer.ckpt_every=2", f"run_dir={run}")).fit()
    return run


def test_the_run_banner_names_the_recipe(tmp_path, capsys):
    from train.trainer import Trainer

    for routing, recipe in [("sprint", "SPRINT (structured selection: 0.75 bypass blocks 2..-3, path drop 0.1)"),
                            ("structured", "TREAD (structured selection: 0.5 bypass blocks 2..-4)"), ("none", "dense (no routing)")]:
        Trainer(compose_cfg(*FAST, "trainer.max_steps=1", f"routing={routing}", f"run_dir={tmp_path / routing}")).fit()
        assert f"routing={recipe}, data=digits" in capsys.readouterr().out


def test_sampling_keeps_every_grid_and_names_the_rule(sprint_run):
    ckpt = sprint_run / "checkpoints" / "step_0000002"
    common = ["--steps", "2", "--per-class", "1"]
    rules = {(): "no guidance", ("--pdg-scale", "2"): "path-drop guidance w=2", ("--guidance", "2"): "CFG w=2",
             ("--route-ratio", "0.5"): "no guidance + routed inference at ratio 0.5"}
    written = {}
    for flags, rule in rules.items():
        result = run_cli("train.sample", str(sprint_run), *common, *flags)
        assert result.returncode == 0, result.stderr[-2000:]
        last = result.stdout.strip().splitlines()[-1]
        assert last.startswith("wrote ") and last.endswith(f"rule: {rule})"), last
        assert "sampling a SPRINT (structured selection" in result.stdout
        written[flags] = ckpt / last.split()[1]
    assert len(set(written.values())) == len(rules) and all(p.parent == ckpt and p.exists() for p in written.values())
    assert written[("--pdg-scale", "2")].name == "samples_pdg2_heun2_seed0_n1.png"

    # The same command again keeps the file and says how to replace it or write elsewhere, in one sentence.
    pdg = written[("--pdg-scale", "2")]
    before = (pdg.read_bytes(), pdg.stat().st_mtime_ns)
    again = run_cli("train.sample", str(sprint_run), *common, "--pdg-scale", "2")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    message = again.stderr.strip().splitlines()[-1]
    assert f"'{pdg}' exists" in message and "--overwrite" in message and "--out" in message
    assert (pdg.read_bytes(), pdg.stat().st_mtime_ns) == before
    out = sprint_run.parent / "grid.png"
    out.write_bytes(b"mine")
    refused = run_cli("train.sample", str(sprint_run), *common, "--out", str(out))
    assert refused.returncode == 2 and out.read_bytes() == b"mine"
    replaced = run_cli("train.sample", str(sprint_run), *common, "--pdg-scale", "2", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert pdg.stat().st_mtime_ns != before[1]


def test_defaults_that_differ_from_the_runs_previews_are_named_in_one_line_each():
    from omegaconf import OmegaConf

    from train.sample import preview_notes

    wan_like = OmegaConf.create({"sample": {"guidance": 5.0, "steps": 30}})
    assert preview_notes(parse_args(["runs/x"]), wan_like) == [
        "note: guidance 1.0 (this run's previews use 5.0: --guidance 5 for those)",
        "note: steps 40 (this run's previews use 30: --steps 30 for those)"]
    # A flag the user gave is theirs, and settings the previews share need no word.
    assert preview_notes(parse_args(["runs/x", "--guidance", "1", "--steps", "30"]), wan_like) == []
    assert preview_notes(parse_args(["runs/x"]), OmegaConf.create({"sample": {"guidance": 1.0, "steps": 40}})) == []
    assert preview_notes(parse_args(["runs/x", "--pdg-scale", "2"]), wan_like) == [  # no CFG beside path-drop guidance
        "note: steps 40 (this run's previews use 30: --steps 30 for those)"]
    args = parse_args(["runs/x"])
    assert (args.guidance, args.steps) == (1.0, 40)  # the defaults that documented numbers use stay


@pytest.mark.parametrize("made, message", [
    ({".hydra/config.yaml": "a: 1\n", "metrics.jsonl": ""},
     "is a run folder with no checkpoint yet; wait for its first one"),
    ({"metrics.jsonl": "", "checkpoints/latest": "step_0000004\n"},
     "is a run folder whose checkpoints/latest names step_0000004, which is missing"),
    ({"notes.txt": "not a run"}, "is neither a checkpoint folder nor a run folder"),
])
def test_a_run_folder_without_a_checkpoint_says_so_in_one_sentence(tmp_path, made, message):
    run = tmp_path / "run"
    for name, text in made.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    result = run_cli("train.sample", str(run), "--steps", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: '{run}' {message}"), line
    if "no checkpoint yet" in message:
        assert "trainer.ckpt_every" in line


def test_pretrained_on_a_run_trained_from_scratch_is_refused_in_one_sentence(sprint_run):
    from routing import ConfigError
    from train.checkpoint import load_run

    with pytest.raises(ConfigError, match="--pretrained is for fine-tuning runs; .* trained its model from scratch"):
        load_run(sprint_run, pretrained="weights/flux")
