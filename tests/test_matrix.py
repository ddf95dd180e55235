"""Every family x every routing recipe in configs/routing/ x trainer.mixed_precision no / bf16 trains two steps.

The real Hydra configs and the real Trainer, at the tiniest shapes the routes allow: 16x16 digits with patch 4
(a 4x4 token grid), width 32, depth 6 (the recipes' routes r2->-4 and r2->-3 need six blocks). A recipe whose
policy picks tokens without a grid does not apply to a scan-order family (RWKV, Mamba): that cell checks the
one-sentence refusal instead. The recipes are read from the config folder, so a new one joins the matrix.

adaLN-Zero and the zero-initialised output layer make a fresh network the identity with a zero output, so two
steps would train little beyond the final layer and the loss would not depend on the routed blocks at all.
The test gives those zero tensors small random values first: then the first step already sends gradients
through every block, every route and every fusion, in the precision under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from backbones import FAMILIES, family_module
from backbones.common import SparseDenseFusion
from routing import ConfigError
from routing.policy import POLICIES
from train.trainer import Trainer

from conftest import CONFIGS, FAST, compose_cfg

TINY = ["backbone.depth=6", "backbone.hidden_size=32", "trainer.log_with=none"]
RECIPES = sorted(p.stem for p in (CONFIGS / "routing").glob("*.yaml"))


def applies(family: str, recipe: str) -> bool:
    """The project's own rule (train/build.py): a grid-needing block refuses a grid-less policy's routes."""
    cfg = OmegaConf.load(CONFIGS / "routing" / f"{recipe}.yaml")
    gridless = bool(cfg.routes) and not POLICIES[cfg.policy].yields_grid
    return not (family_module(family).Block.needs_grid and gridless)


CELLS = [(f, r) for f in FAMILIES for r in RECIPES if applies(f, r)]
REFUSED = [(f, r) for f in FAMILIES for r in RECIPES if not applies(f, r)]


def _wake(model: torch.nn.Module) -> None:
    """Small random values in every all-zero parameter (adaLN-Zero, the final layer, zero biases)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _train(tmp_path: Path, family: str, recipe: str, precision: str, *extra: str):
    cfg = compose_cfg(*FAST, *TINY, f"backbone={family}", f"routing={recipe}", f"trainer.mixed_precision={precision}",
                      f"run_dir={tmp_path / 'run'}", *extra)
    trainer = Trainer(cfg)
    net = trainer.backbone
    _wake(net)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    # The residual stream entering the last block, and the dtype the final Linear computes in.
    seen: dict[str, torch.dtype] = {}

    def record(key: str, tensor: torch.Tensor) -> None:  # hooks must return None, or they replace the tensors
        seen.setdefault(key, tensor.dtype)

    net.blocks[-1].register_forward_pre_hook(lambda m, args: record("stream", args[0]))
    net.final_layer.linear.register_forward_hook(lambda m, args, out: record("linear", out))
    losses = trainer.fit()
    unchanged = [name for name, p in net.named_parameters() if torch.equal(before[name], p.detach())]
    return trainer, losses, unchanged, seen


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("family,recipe", CELLS)
def test_every_family_trains_every_recipe_in_both_precisions(tmp_path, family, recipe, precision):
    trainer, losses, unchanged, seen = _train(tmp_path, family, recipe, precision)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
    assert trainer.skipped_steps == 0
    assert not unchanged, f"no update reached {unchanged}"
    routed = bool(OmegaConf.load(CONFIGS / "routing" / f"{recipe}.yaml").routes)
    assert len(trainer.backbone.route_masks()) == routed  # the last step ran its route
    # Mixed precision computes the matmuls in bf16 but keeps the residual stream in fp32, after a SPRINT fusion too.
    assert seen["linear"] == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert seen["stream"] == torch.float32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_block_after_a_route_trains_in_fp32_under_bf16(tmp_path, family):
    recipe = "rows" if family_module(family).Block.needs_grid else "random"
    for routing in (recipe, "sprint"):
        trainer, losses, unchanged, _ = _train(tmp_path / routing, family, routing, "bf16", "routing.fp32_after_route=true")
        assert all(torch.isfinite(torch.tensor(losses))) and not unchanged, (routing, losses, unchanged)


@pytest.mark.parametrize("family,recipe", REFUSED)
def test_a_recipe_that_does_not_apply_is_refused_in_one_sentence(tmp_path, family, recipe):
    with pytest.raises(ConfigError, match="routing=rows") as refusal:
        Trainer(compose_cfg(*FAST, *TINY, f"backbone={family}", f"routing={recipe}", f"run_dir={tmp_path / 'run'}"))
    assert "\n" not in str(refusal.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_the_sprint_fusion_returns_the_residual_streams_dtype():
    fusion = SparseDenseFusion(16)
    deep, shallow = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fusion(deep.bfloat16(), shallow).dtype == torch.float32  # the Linear ran in bf16, the stream stays fp32
    assert fusion(deep, shallow).dtype == torch.float32
    assert fusion.bfloat16()(deep.bfloat16(), shallow.bfloat16()).dtype == torch.bfloat16  # a bf16 model stays bf16
