"""A fine-tune on data=latents trains in its pretrained model's latent space: the README's Flux command works as
written (data.normalize=auto takes the VAE's scaling and shift), and standardised latents or a cache of another VAE
are refused in one sentence before anything is written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from conftest import FAST, run_cli
from test_finetune_cli import TABLE_SIZES, TINY
from test_latents import cache_args, make_images
from tiny_pipelines import tiny_vae
from train.cache_latents import main as cache_latents
from train.data.latents import build
from train.data.prompts import random_table, write_table

SCALING, SHIFT = 0.5, 0.1  # tiny_vae's factors, Flux's convention (a shift as well as a scale)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A tiny Flux pipeline folder (transformer/ and vae/, 1 latent channel that Flux packs 2x2), its latents cache of
    3 classes at 16 px, and a prompt table for the 3 classes."""
    import diffusers

    root = tmp_path_factory.mktemp("flux")
    torch.manual_seed(0)
    diffusers.FluxTransformer2DModel(**TINY["flux"]).save_pretrained(root / "pipeline" / "transformer")
    tiny_vae(latent_channels=1).save_pretrained(root / "pipeline" / "vae")
    cache_latents(cache_args(make_images(root / "images"), root / "latents", root / "pipeline" / "vae"))
    table = write_table(random_table("flux", ["a photo of a cat", "a photo of a dog", "a photo of an emu"], TABLE_SIZES["flux"]),
                        root / "prompts.safetensors")
    return {"root": root, "pipeline": root / "pipeline", "latents": root / "latents", "prompts": table}


def readme_command(flux, pipeline=None) -> list[str]:
    """README's `python -m train +experiment=finetune_flux finetune.pretrained=... finetune.prompts=... data=latents
    data.path=...`, plus what makes it fast on a CPU (none of it about the data)."""
    fast = [a for a in FAST if not a.startswith("trainer.ckpt_every=")]
    return ["+experiment=finetune_flux", f"finetune.pretrained={pipeline or flux['pipeline']}", f"finetune.prompts={flux['prompts']}",
            "data=latents", f"data.path={flux['latents']}", *fast, "trainer.ckpt_every=2", "finetune.dtype=fp32",
            "finetune.gradient_checkpointing=false", "trainer.mixed_precision=no", "finetune.lora.rank=4"]


def test_the_readme_flux_command_trains_in_the_vae_latent_space(flux, tmp_path):
    from train.checkpoint import load_run

    run = tmp_path / "run"
    result = run_cli("train", *readme_command(flux), f"run_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    dataset = load_run(run).dataset
    z = torch.randn(2, 1, 8, 8)
    assert torch.allclose(dataset.to_model_space(z), (z - SHIFT) * SCALING)


def test_standardised_latents_are_refused_for_a_fine_tune(flux, tmp_path):
    refused = run_cli("train", *readme_command(flux), "data.normalize=standardize", f"run_dir={tmp_path / 'run'}")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    message = refused.stderr.strip()
    assert "\n" not in message and message.startswith("error: data.normalize=standardize")
    assert "pass data.normalize=scale" in message and not (tmp_path / "run").exists()


def test_a_cache_of_another_vae_is_refused(flux, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(flux["pipeline"], other)
    config = json.loads((other / "vae" / "config.json").read_text())
    (other / "vae" / "config.json").write_text(json.dumps({**config, "scaling_factor": 0.25}))
    refused = run_cli("train", *readme_command(flux, pipeline=other), f"run_dir={tmp_path / 'run'}")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    message = refused.stderr.strip()
    assert "\n" not in message and "scaling_factor 0.5 and shift_factor 0.1 (its meta.json)" in message
    assert "has 1, 0.25 and 0.1" in message and f"--vae {other / 'vae'}" in message and not (tmp_path / "run").exists()


def test_auto_standardises_a_model_trained_from_scratch(flux):
    data = {"name": "latents", "path": str(flux["latents"]), "vae": None}
    auto = build(OmegaConf.create({**data, "normalize": "auto"}), sigma_data=0.5)
    standard = build(OmegaConf.create({**data, "normalize": "standardize"}), sigma_data=0.5)
    z = torch.randn(2, 1, 8, 8)
    assert torch.equal(auto.to_model_space(z), standard.to_model_space(z))
    assert not torch.allclose(auto.to_model_space(z), (z - SHIFT) * SCALING)
