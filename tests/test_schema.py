"""The typed schema: a wrong-type and an out-of-range case for every numeric key, generated from the schema
itself, plus the CLI contract (one sentence, exit code 2, no traceback, the key named)."""

import functools

import pytest
from omegaconf import OmegaConf

from routing import ConfigError
from train.schema import check_config, numeric_keys
from train.schema.keys import describe_range, out_of_range_example
from conftest import compose_cfg, run_cli, run_module

NUMERIC = numeric_keys()
IDS = [f"{key}{'[' + ','.join(o) + ']' if o else ''}" for o, key, _, _ in NUMERIC]


@functools.lru_cache(maxsize=None)
def base(overrides: tuple[str, ...]) -> dict:
    return OmegaConf.to_container(compose_cfg("run_dir=/tmp/unused", *overrides))


def with_value(overrides, key, value) -> OmegaConf:
    plain = OmegaConf.create(base(tuple(overrides)))
    OmegaConf.update(plain, key, value, force_add=True)
    return plain


def test_the_composed_defaults_pass():
    for overrides in {o for o, *_ in NUMERIC}:
        check_config(OmegaConf.create(base(overrides)))


def test_every_numeric_key_has_a_range_and_an_example():
    assert len(NUMERIC) > 40
    for _, key, _, meta in NUMERIC:
        assert describe_range(meta), key
        assert meta.get("example") is not None and meta.get("help"), key


@pytest.mark.parametrize("overrides, key, kind, meta", NUMERIC, ids=IDS)
def test_wrong_type_is_refused_naming_the_key(overrides, key, kind, meta):
    bad = ["abc", 0.5] if key.endswith("betas") else "abc"
    with pytest.raises(ConfigError) as err:
        check_config(with_value(overrides, key, bad))
    assert key in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, key, kind, meta", NUMERIC, ids=IDS)
def test_out_of_range_is_refused_naming_the_key_range_and_an_example(overrides, key, kind, meta):
    value = kind(out_of_range_example(meta))
    with pytest.raises(ConfigError, match="out of range") as err:
        check_config(with_value(overrides, key, [value, 0.9] if key.endswith("betas") else value))
    message = str(err.value)
    assert key in message and describe_range(meta) in message and "(e.g." in message


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+backbone.kwargs.num_heads=5"], "backbone.kwargs.num_heads=5 does not divide the width"),
        (["+backbone.kwargs.heads=4"], "backbone.kwargs.heads is not an argument of the dit block"),
        (["+backbone.kwargs.mlp_ratio=fast"], "backbone.kwargs.mlp_ratio='fast' is not a number"),
        (["backbone=mamba", "+backbone.kwargs.num_heads=4"], "not an argument of the mamba block"),
        (["fid.every=5"], "fid.ref is not set"),
        (["fid.every=5", "fid.ref=/nonexistent/ref.npz"], "fid.ref='/nonexistent/ref.npz' does not exist"),
        (["objective=flow", "objective.time_dist=beta"], "objective.time_dist='beta' is unknown"),
        (["+data.foo=1"], "data.foo is not a config key"),
    ],
)
def test_other_checks_before_any_work(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_config(compose_cfg("run_dir=/tmp/unused", *overrides))


def test_family_kwargs_that_fit_pass():
    check_config(compose_cfg("run_dir=/tmp/unused", "+backbone.kwargs.num_heads=8"))
    check_config(compose_cfg("run_dir=/tmp/unused", "backbone=mamba", "+backbone.kwargs.d_state=8"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_steps=abc", "trainer.max_steps='abc' is not an integer"),
        ("trainer.lr=-1", "trainer.lr=-1.0 is out of range; it must be in (0, 1]"),
        ("trainer.keep_checkpoints=-1", "trainer.keep_checkpoints=-1 is out of range"),
        ("backbone.kwargs.num_heads=8", "+backbone.kwargs.num_heads=8"),
        ("trainer.nonsense=1", "trainer.nonsense is not a config key"),
    ],
)
def test_cli_refuses_in_one_sentence_with_exit_code_2(override, message, tmp_path):
    result = run_cli("train", override, f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run folder


def test_another_data_options_key_names_that_option_and_an_unknown_key_asks_for_its_spelling(tmp_path):
    """A key of another data option given on the command line names the option that has it (the hint needs the options
    the other overrides chose); a key nothing has asks the user to check its spelling, not to declare it in the
    schema."""
    result = run_cli("train", "data=latents", "data.frames=9", f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert "data.frames is a key of data=videos, not of data=latents" in result.stderr, result.stderr
    result = run_cli("train", "trainer.nonsense=1", f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 2 and "check its spelling" in result.stderr and "train/schema" not in result.stderr


def test_help_lists_every_key_with_its_range():
    result = run_cli("train", "--help")
    assert result.returncode == 0, result.stderr
    assert "trainer.max_bad_steps=20" in result.stdout and "[>= 1]" in result.stdout
    assert "data.num_images" in result.stdout and "objective.shift" in result.stdout


@pytest.mark.parametrize(
    "module, args, message",
    [
        ("train.sample", ["runs/none", "--steps", "0"], "argument --steps: 0 is out of range"),
        ("train.fid", ["--checkpoint", "runs/none", "--ref", "ref.npz"], "argument --checkpoint: checkpoint 'runs/none' does not exist"),
        ("train.cache_latents", ["--images", ".", "--out", "/tmp/x", "--batch-size", "-2"], "argument --batch-size: -2 is out of range"),
        ("train.bench", ["bench=nope"], "Could not find 'bench/nope'"),
    ],
)
def test_commands_refuse_bad_flags_in_one_sentence(module, args, message):
    result = run_cli(module, *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_real_process_refuses_as_the_in_process_runs_do(tmp_path):
    # The refusal tests call the entry points in-process (run_cli); `python -m` must behave the same. Hydra's app is the
    # one with state to leak (job logging, sys.argv); the argparse commands print their error and exit alike.
    args = ("trainer.nonsense=1", f"run_dir={tmp_path / 'run'}")
    real, here = run_module("train", *args), run_cli("train", *args)
    assert real.returncode == here.returncode == 2
    assert real.stderr == here.stderr and len(real.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
