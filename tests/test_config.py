"""Every config group composes with hydra.compose and trains one step; bad configs fail with one sentence."""

import json
from pathlib import Path

import pytest

from routing import ConfigError
from train.trainer import Trainer, check_config
from conftest import CONFIGS, compose_cfg, run_cli

GROUPS = {g: sorted(p.stem for p in (CONFIGS / g).glob("*.yaml")) for g in ("backbone", "routing", "data")}
# Latents need a cached folder (tests/test_latents.py covers them), Fashion-MNIST its apt package
# (tests/test_fashion_mnist.py trains on fake idx files), and captions and videos a pipeline to fine-tune
# (tests/test_captions.py and tests/test_videos.py train on them); every other option trains here.
ELSEWHERE = (("data", "latents"), ("data", "fashion_mnist"), ("data", "captions"), ("data", "videos"))
TRAINABLE = [(g, o) for g, opts in GROUPS.items() for o in opts if (g, o) not in ELSEWHERE]


def test_every_group_has_options():
    assert {"dit", "rwkv", "mamba"} <= set(GROUPS["backbone"])
    assert {"none", "random", "rows"} <= set(GROUPS["routing"])
    assert {"digits", "shapes"} <= set(GROUPS["data"])


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes(group, option):
    cfg = compose_cfg(f"{group}={option}")
    assert cfg[group]
    assert cfg.trainer.max_steps > 0 and cfg.edm.sigma_data > 0


@pytest.mark.parametrize("group, option", TRAINABLE)
def test_one_training_step_per_option(group, option, cfg_factory):
    overrides = [f"{group}={option}", "trainer.max_steps=1", "trainer.ckpt_every=1"]
    if group == "routing":
        overrides += ["backbone=dit"]
    if group == "backbone":
        overrides += ["routing=rows"]
    if option == "shapes":
        overrides += ["data.num_images=64", "data.resolution=16"]
    cfg = cfg_factory(*overrides)
    losses = Trainer(cfg).fit()
    assert len(losses) == 1 and losses[0] > 0
    run = Path(cfg.run_dir)
    assert (run / "config.yaml").exists() and (run / "checkpoints" / "latest").exists()
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1


@pytest.mark.parametrize("backbone", ["rwkv", "mamba"])
def test_grid_needing_backbone_rejects_unstructured_routing_unless_opted_in(backbone, cfg_factory):
    with pytest.raises(ConfigError, match="routing=rows"):
        Trainer(cfg_factory(f"backbone={backbone}", "routing=random"))
    trainer = Trainer(cfg_factory(f"backbone={backbone}", "routing=random", "routing.allow_unstructured=true"))
    assert trainer.backbone.router.policy.name == "random"


def test_routes_override_from_command_line(cfg_factory):
    cfg = cfg_factory("routing=random", "routing.routes=[{selection_ratio:0.25,start_layer_idx:1,end_layer_idx:-2}]")
    route = Trainer(cfg).backbone.router.routes[0]
    assert (route.selection_ratio, route.start_layer_idx, route.end_layer_idx) == (0.25, 1, 6)


def test_batch_not_divisible_by_processes(cfg_factory):
    with pytest.raises(ConfigError, match=r"trainer.batch_size=4 is not divisible by 3 processes"):
        check_config(cfg_factory(), num_processes=3)
    with pytest.raises(ConfigError, match="trainer.grad_accum=3"):
        Trainer(cfg_factory("trainer.grad_accum=3"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("backbone=transformer", "Could not find 'backbone/transformer'"),
        ("backbone.preset=XXL", "backbone.preset='XXL' is unknown for dit"),
        ("backbone.patch_size=3", "not divisible by backbone.patch_size=3"),
        ("data.name=imagenet", "data.name='imagenet' is unknown"),
        ("trainer.mixed_precision=fp8", "trainer.mixed_precision='fp8' is unknown"),
        ("routing=random", None),
    ],
)
def test_cli_errors_are_one_sentence(override, message, tmp_path):
    if message is None:  # a control: a good override must run
        result = run_cli("train", override, "trainer.max_steps=1", "trainer.batch_size=2", "trainer.sample_every=0",
                            "trainer.ckpt_every=0", "trainer.cpu=true", f"run_dir={tmp_path}")
        assert result.returncode == 0, result.stderr
        return
    result = run_cli("train", override, f"run_dir={tmp_path}")
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_imagenet_experiment_sets_the_paper_hyperparameters():
    cfg = compose_cfg("+experiment=imagenet_dit", "data.path=/data/latents")
    assert (cfg.backbone.preset, cfg.backbone.patch_size, cfg.routing.policy) == ("XL", 2, "random")
    assert (cfg.trainer.lr, cfg.trainer.batch_size, cfg.trainer.mixed_precision) == (1e-4, 256, "bf16")
    assert cfg.routing.routes[0] == {"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -4}
    assert cfg.data.name == "latents"


@pytest.mark.parametrize("backbone", ["dit", "rwkv", "mamba"])
def test_bf16_training_step_with_fp32_block_after_route(backbone, cfg_factory):
    cfg = cfg_factory(f"backbone={backbone}", "routing=rows", "trainer.mixed_precision=bf16", "routing.fp32_after_route=true")
    losses = Trainer(cfg).fit()
    assert len(losses) == 2 and all(0 < loss < 100 for loss in losses)
