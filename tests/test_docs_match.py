"""Numbers and names the docs state, checked against the code that they describe."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import torch

DOCS = Path(__file__).parents[1] / "docs"


def test_the_evidence_script_states_its_model_width():
    script = runpy.run_path(str(DOCS / "figures" / "tread_lora_evidence.py"))
    width = script["FLUX"]["num_attention_heads"] * script["FLUX"]["attention_head_dim"]
    assert re.findall(r"(\d+) wide", script["__doc__"]) == [str(width)]


def test_path_drop_guidance_cost_at_sprint_xl_split_is_the_documented_share_of_cfg():
    """DiT-XL/2 (28 blocks) with SPRINT's route over blocks 2..25 (2 + 24 + 2), 256 tokens, counted on the meta device."""
    from backbones import build_backbone
    from edm import EDMPrecond, with_path_drop_guidance
    from edm.guidance import CFGDenoiser
    from routing import Route, Router, build_policy, count_flops

    with torch.device("meta"):
        model = build_backbone("dit", "XL", input_size=32, in_channels=4, patch_size=2, num_classes=1000)
        model.attach_router(Router(build_policy("structured"), [Route(0.75, 2, 25, "sprint", 0.1)]))
        net = EDMPrecond(model).eval()
        x, t, y = torch.zeros(1, 4, 32, 32), torch.ones(1), torch.zeros(1, dtype=torch.long)
        cfg = count_flops(lambda: CFGDenoiser(net, 2.0, 1000)(x, t, y))
        pdg = count_flops(lambda: with_path_drop_guidance(net, model.router, 2.0, 1000)(x, t, y))
    text = (DOCS / "sampling.md").read_text()
    assert f"costs {pdg / cfg:.2f} of CFG's: {pdg / 1e9:.1f} G against {cfg / 1e9:.1f} G" in text


def test_the_documented_lora_files_are_the_ones_save_lora_writes(tmp_path):
    from backbones.adapters import add_lora, save_lora
    from test_adapters import build

    model = build("flux")
    add_lora(model, rank=2)
    written = sorted(p.name for p in save_lora(model, tmp_path / "lora").iterdir())
    text = (DOCS / "finetuning_api.md").read_text()
    section = text[text.index("`save_lora(model, folder)` writes"):text.index("`load_pretrained(family, path)` loads")]
    assert re.findall(r"`([a-z_]+\.(?:safetensors|json))`", section.split("\n\n")[1]) == [
        "pytorch_lora_weights.safetensors", "adapter_model.safetensors", "adapter_config.json", "tread_zoo_lora.json"]
    assert sorted(set(re.findall(r"`([a-z_]+\.(?:safetensors|json))`", section.split("\n\n")[1]))) == written
    assert "loads it for Flux, SD3 and Wan" in section
