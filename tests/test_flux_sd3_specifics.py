"""Flux's distilled guidance (finetune.guidance, train.sample --flux-guidance) and the time shifts of the training draws and
the sampling grid: SD3's fixed shift, Flux's resolution-dependent one, each switchable."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from backbones.adapters import adapt, load_pretrained, resolution_shift
from edm import flow_times, shift_time
from routing import ConfigError
from train.build import sampling_objective
from train.data.prompts import random_table, write_table
from train.schema import check_config
from train.trainer import Trainer, seeded
from conftest import FAST, compose_cfg
from test_finetune_cli import TABLE_SIZES, write_pretrained


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    """A tiny guidance-embedding Flux (as FLUX.1-dev) and a prompt table for the 10 digit classes."""
    root = tmp_path_factory.mktemp("flux-dev")
    model = write_pretrained("flux", root / "model", guidance_embeds=True)
    table = write_table(random_table("flux", [str(d) for d in range(10)], TABLE_SIZES["flux"]), root / "prompts.safetensors")
    return model, table


def preset(flux_dev, tmp_path, *extra):
    model, table = flux_dev
    return compose_cfg("+experiment=finetune_flux", f"finetune.pretrained={model}", f"finetune.prompts={table}", "finetune.dtype=fp32",
                       "finetune.gradient_checkpointing=false", "trainer.mixed_precision=no", "finetune.lora.rank=4", "data=digits",
                       *FAST, f"run_dir={tmp_path / 'run'}", *extra)


def test_the_shift_formula_and_fluxs_resolution_shift(tmp_path):
    t = torch.linspace(0, 1, 11, dtype=torch.float64)
    assert torch.equal(flow_times(10, 3.0).flip(0), shift_time(t, 3.0)) and torch.equal(shift_time(t, 1.0), t)
    shift = resolution_shift()  # diffusers' FlowMatchEulerDiscreteScheduler defaults: FLUX.1's
    assert math.isclose(shift(256), math.exp(0.5)) and math.isclose(shift(4096), math.exp(1.15))
    import diffusers

    diffusers.FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=2.0).save_pretrained(tmp_path / "pipe" / "scheduler")
    assert math.isclose(resolution_shift(tmp_path / "pipe")(4096), math.exp(2.0))  # a pipeline folder's own constants


def test_training_draws_and_the_sampling_grid_shift_as_configured(flux_dev, tmp_path):
    trainer = Trainer(preset(flux_dev, tmp_path, "trainer.max_steps=1"))  # the preset: Flux's shift on both
    seen = []
    loss = trainer.objective.loss
    trainer.objective.loss = lambda net, x, labels, t, noise: seen.append(t.clone()) or loss(net, x, labels, t, noise)
    trainer.train_step()
    drawn = trainer.objective.sample_time(4, seeded(0, 0, 0))  # the step's draw, before any shift
    tokens = (16 // 2) ** 2  # digits: 16x16 latents, packed 2x2
    expected = shift_time(drawn, math.exp((1.15 - 0.5) / (4096 - 256) * (tokens - 256) + 0.5))
    assert torch.allclose(seen[0], expected, atol=1e-6) and not torch.allclose(seen[0], drawn)
    sampled = sampling_objective(trainer.cfg, trainer.objective, trainer.backbone, (1, 16, 16))
    assert math.isclose(sampled.shift, trainer.train_shift((1, 16, 16)))

    fixed = Trainer(preset(flux_dev, tmp_path, "finetune.train_shift=fixed", "finetune.sample_shift=fixed", "overwrite=true"))
    assert fixed.train_shift((1, 16, 16)) == 3.0
    assert sampling_objective(fixed.cfg, fixed.objective, fixed.backbone, (1, 16, 16)) is fixed.objective  # objective.shift's grid
    off = Trainer(preset(flux_dev, tmp_path, "finetune.train_shift=none", "overwrite=true"))
    assert off.train_shift is None


def test_flux_guidance_reaches_the_guidance_embedding_in_training_and_sampling(flux_dev, tmp_path):
    trainer = Trainer(preset(flux_dev, tmp_path, "finetune.guidance=3.5"))
    adapter = trainer.backbone.adapter
    assert adapter.guidance == 3.5
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 1, 16, 16, generator=g), torch.rand(2, generator=g)
    cond = {"encoder_hidden_states": torch.randn(2, 4, 24, generator=g), "pooled_projections": torch.randn(2, 12, generator=g)}
    adapter.eval()
    with torch.no_grad():
        given, default = adapter(x, t, {**cond, "guidance": 3.5}), adapter(x, t, cond)
        assert torch.equal(given, default) and not torch.equal(default, adapter(x, t, {**cond, "guidance": 1.0}))
        assert torch.equal(default, adapter.reference(x, t, {**cond, "guidance": 3.5}))

    from train.sample import set_flux_guidance

    trainer.fit()
    trainer.save()
    from train.checkpoint import load_run

    loaded = load_run(tmp_path / "run")
    assert loaded.net.model.adapter.guidance == 3.5  # the run's value, unless the flag says otherwise
    set_flux_guidance(loaded, 2.0)
    assert loaded.net.model.adapter.guidance == 2.0


def test_guidance_without_a_guidance_embedding_is_refused(flux_dev, tmp_path):
    model = write_pretrained("flux", tmp_path / "schnell")  # guidance_embeds=False, as FLUX.1-schnell
    with pytest.raises(ConfigError, match=r"has no guidance embedding \(guidance_embeds=false"):
        Trainer(preset(flux_dev, tmp_path, f"finetune.pretrained={model}", "finetune.guidance=3.5"))
    with pytest.raises(ConfigError, match="finetune.guidance=3.5 is Flux's distilled guidance, but finetune.family=dit has none"):
        check_config(compose_cfg("objective=flow", "finetune.family=dit", f"finetune.pretrained={write_pretrained('dit', tmp_path / 'dit')}",
                                 "finetune.guidance=3.5", "run_dir=/tmp/unused"))


def test_old_configs_without_the_new_keys_keep_their_behaviour(flux_dev, tmp_path):
    """A run folder saved before finetune.guidance, train_shift and sample_shift existed trains and samples as it did."""
    from omegaconf import OmegaConf

    from train.build import time_shift

    cfg = preset(flux_dev, tmp_path)
    plain = OmegaConf.to_container(cfg)
    for name in ("guidance", "train_shift", "sample_shift"):
        del plain["finetune"][name]
    old = OmegaConf.create(plain)
    assert time_shift(old, "train", 2) is None and time_shift(old, "sample", 2) is None
    objective = dataclasses.replace(Trainer(cfg).objective)
    assert sampling_objective(old, objective, adapt(load_pretrained("flux", flux_dev[0])), (1, 16, 16)) is objective
