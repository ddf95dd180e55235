"""SPRINT routes on every backbone: sparse-dense fusion, path drop, path-drop guidance, the second stage; and TREAD
routes and unrouted models unchanged by all of it."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from backbones import build_backbone
from edm import PathDropGuidance, generate
from routing import ConfigError, Router, build_policy, count_flops, resolve_routes
from train.schema import resume_changes

SPRINT = {"selection_ratio": 0.75, "start_layer_idx": 2, "end_layer_idx": -3, "mode": "sprint", "path_drop": 0.5}


def sprint_model(family="dit", route=SPRINT, depth=6, **kwargs):
    torch.manual_seed(0)
    model = build_backbone(family, "tiny", input_size=16, in_channels=1, patch_size=2, num_classes=10, depth=depth,
                           hidden_size=32, **kwargs)
    for p in model.parameters():  # non-zero adaLN and final layers, so every block and token matters
        nn.init.normal_(p, std=0.05)
    model.attach_router(Router(build_policy("structured"), resolve_routes([route], depth)))
    return model


def inputs(b=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 1, 16, 16, generator=g), torch.rand(b, generator=g), torch.tensor([1, 2, 3, 4][:b])


def reference(model, x, t, y, *, generator=None, training=True, drop_all=False):
    """SPRINT written out by hand: dense encoder, sparse middle on the structured subset, mask tokens, path drop,
    Linear(2D -> D) over concat(deep, shallow), dense decoder."""
    b, n, d = x.shape[0], 64, 32
    tokens = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y, b, x.device)
    for i in range(2):
        tokens = model.blocks[i](tokens, c, model.grid)
    shallow, fusion = tokens, model.fusions["2"]
    mask = fusion.mask_token.expand(b, n, d)
    if drop_all:
        deep = mask
    elif training:
        sel = build_policy("structured").select(tokens, model.grid, 0.75, generator)
        sub = torch.stack([tokens[k, sel.indices[k]] for k in range(b)])
        for i in range(2, 4):
            sub = model.blocks[i](sub, c, sel.grid)
        deep = mask.clone()
        for k in range(b):
            deep[k, sel.indices[k]] = sub[k]
        dropped = torch.rand(b, 1, generator=generator) < SPRINT["path_drop"]
        deep = torch.where(dropped[:, :, None], mask, deep)
    else:
        deep = tokens
        for i in range(2, 4):
            deep = model.blocks[i](deep, c, model.grid)
    h = fusion.proj(torch.cat([deep, shallow], dim=-1))
    for i in range(4, 6):
        h = model.blocks[i](h, c, model.grid)
    return model.unpatchify(model.final_layer(h, c))


@pytest.mark.parametrize("family", ["dit", "rwkv"])
def test_the_fusing_route_is_sprint_in_training_inference_and_path_drop(family):
    model = sprint_model(family)
    x, t, y = inputs()
    with torch.no_grad():
        model.train()
        model.router.generator = torch.Generator().manual_seed(5)
        out = model(x, t, y)
        torch.testing.assert_close(out, reference(model, x, t, y, generator=torch.Generator().manual_seed(5)), rtol=0, atol=1e-6)
        model.eval()  # inference: every token runs the middle, and the fusion stays
        torch.testing.assert_close(model(x, t, y), reference(model, x, t, y, training=False), rtol=0, atol=1e-6)
        with model.router.path_dropped():  # PDG's weak branch: mask tokens only, the middle skipped
            torch.testing.assert_close(model(x, t, y), reference(model, x, t, y, drop_all=True), rtol=0, atol=1e-6)
    assert [n for n, _ in model.named_parameters() if "fusions" in n] == ["fusions.2.proj.weight", "fusions.2.proj.bias"]
    assert "fusions.2.mask_token" in model.state_dict() and not model.fusions["2"].mask_token.requires_grad


def test_path_drop_draws_per_sample_with_its_probability():
    class Deep(nn.Module):  # the fusion returns the deep path, so a dropped sample is all mask tokens
        mask_token = torch.full((1, 1, 4), 7.0)

        def forward(self, deep, shallow):
            return deep

    counts = {}
    for p in (0.0, 0.3, 1.0):
        route = resolve_routes([{**SPRINT, "start_layer_idx": 0, "end_layer_idx": 0, "path_drop": p}], 1)
        router = Router(build_policy("structured"), route)
        router.generator = torch.Generator().manual_seed(0)
        out = router.run([lambda x, c, grid: x], torch.zeros(4000, 16, 4), None, (4, 4), training=True, fusions={"0": Deep()})
        counts[p] = int((out == 7.0).all(-1).all(-1).sum())
    assert counts[0.0] == 0 and counts[1.0] == 4000
    assert abs(counts[0.3] - 1200) < 5 * (4000 * 0.3 * 0.7) ** 0.5  # binomial, 5 standard deviations


def test_a_sprint_route_without_its_fusion_layer_is_named():
    router = Router(build_policy("structured"), resolve_routes([SPRINT], 6))
    with pytest.raises(ConfigError, match="SPRINT route, but the model has no fusion layer"):
        router.run([lambda x, c, grid: x] * 6, torch.zeros(1, 64, 4), None, (8, 8), training=False)
    with pytest.raises(ConfigError, match="path-drop guidance needs a SPRINT model"), Router().path_dropped():
        pass


@pytest.mark.parametrize("bad, match", [
    ({"path_drop": 1.5}, r"path_drop must be in \[0, 1\]"),
    ({"path_drop": -0.1}, r"path_drop must be in \[0, 1\]"),
    ({"mode": "fuse"}, r"mode must be one of tread, sprint"),
    ({"mode": "tread"}, r"path_drop needs mode: sprint"),
    ({"selection_ratio": "half"}, r"routes\[0\].selection_ratio='half' must be a number"),
    ({"start_layer_idx": 1.5}, r"routes\[0\].start_layer_idx=1.5 must be a whole number"),
])
def test_bad_route_values_are_refused_in_one_sentence_naming_the_key(bad, match):
    with pytest.raises(ConfigError, match=match):
        resolve_routes([{**SPRINT, **bad}], 6)


def test_tread_routes_add_no_weights_and_leave_the_unrouted_model_as_it_was():
    """The fusion layer is SPRINT's alone: a TREAD route adds no weight or buffer to any family, and outside its
    route (eval mode, or ratio 0 in training) the model computes exactly what the unrouted model does. Inside the
    route, tests/test_routing.py replays each TREAD route block by block."""
    g = torch.Generator().manual_seed(1)
    x, t, y = torch.randn(2, 1, 8, 8, generator=g), torch.rand(2, generator=g), torch.tensor([1, 3])
    cases = [("dit", "random", {}), ("dit", "rows", {}), ("rwkv", "rows", {}),
             ("mamba", "rows", {"d_state": 4, "mlp_ratio": 2.0}), ("diffmoe", "random", {"num_experts": 2})]
    for family, policy, kwargs in cases:
        def model_with(routes):
            torch.manual_seed(0)
            model = build_backbone(family, "tiny", input_size=8, in_channels=1, patch_size=2, num_classes=4, depth=6,
                                   hidden_size=32, **kwargs)
            model.attach_router(Router(build_policy(policy if routes else "none"), resolve_routes(routes, 6)))
            return model

        plain = model_with([])
        routed = model_with([{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}])
        idle = model_with([{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": -2}])
        assert routed.state_dict().keys() == plain.state_dict().keys(), f"{family}: no new weights or buffers"
        with torch.no_grad():
            plain.train(), idle.train()
            torch.testing.assert_close(idle(x, t, y), plain(x, t, y), rtol=0, atol=0)
            plain.eval(), routed.eval()
            torch.testing.assert_close(routed(x, t, y), plain(x, t, y), rtol=0, atol=0)


def test_path_drop_guidance_combines_the_full_and_the_weak_branch_at_a_fraction_of_cfgs_flops():
    model = sprint_model().eval()
    x, t, y = inputs()
    with torch.no_grad():
        full = model(x, t, y)
        with model.router.path_dropped():
            weak = model(x, t, torch.full_like(y, 10))
        guided = PathDropGuidance(model, model.router.path_dropped, 3.0, null_label=10)
        torch.testing.assert_close(guided(x, t, y), weak + 3.0 * (full - weak))
        assert not model.router.drop_paths, "the context is left"
    plain = count_flops(lambda: model(x[:1], t[:1], y[:1]))
    pdg = count_flops(lambda: guided(x[:1], t[:1], y[:1]))
    # Depth 6 with 2 encoder and 2 decoder blocks: the weak branch skips 2 of 6 blocks and costs a fusion layer.
    assert plain < pdg < 2 * plain
    samples = generate(guided, torch.tensor([0, 1]), shape=(1, 16, 16), steps=2, guidance=1.0, seed=0, device="cpu",
                       null_label=10, router=model.router)
    assert samples.shape == (2, 1, 16, 16) and torch.isfinite(samples).all()


def test_the_second_stage_may_change_only_ratio_and_path_drop_on_resume():
    stage1 = {"routing": {"routes": [SPRINT]}}
    refused, applied = resume_changes(stage1, {"routing": {"routes": [{**SPRINT, "selection_ratio": 0.0}]}})
    assert refused == [] and applied == ["routing.routes[0].selection_ratio: 0.75 -> 0.0 (SPRINT's second stage: every token "
                                         "runs the middle; the fusion is kept)"]
    refused, _ = resume_changes(stage1, {"routing": {"routes": [{**SPRINT, "end_layer_idx": -2}]}})
    assert refused and "SPRINT route layout" in refused[0]
    refused, _ = resume_changes(stage1, {"routing": {"routes": [{**SPRINT, "mode": "tread", "path_drop": 0}]}})
    assert refused


def test_routing_sprint_trains_every_family_from_the_cli_samples_with_pdg_and_continues_as_stage_two(tmp_path, capsys):
    from conftest import FAST, compose_cfg, run_cli
    from train.sample import main as sample_main
    from train.trainer import Trainer

    run = tmp_path / "dit"
    fast = [a for a in FAST if not a.startswith("trainer.ckpt_every=")]  # a key given twice is refused
    cli = run_cli("train", "backbone=dit", "routing=sprint", *fast, "trainer.ckpt_every=2", f"run_dir={run}")
    assert cli.returncode == 0, cli.stderr[-2000:]
    for family in ("rwkv", "mamba", "diffmoe"):  # the config the CLI composes, trained in-process (cheaper)
        trainer = Trainer(compose_cfg(*FAST, f"backbone={family}", "routing=sprint", f"run_dir={tmp_path / family}"))
        assert len(trainer.fit()) == 2 and len(trainer.backbone.fusions) == 1
    out = sample_main([str(run), "--pdg-scale", "2", "--steps", "2", "--per-class", "1", "--out", str(tmp_path / "pdg.png")])
    assert out.exists() and "of CFG's" in capsys.readouterr().out
    stage2 = Trainer(compose_cfg(*FAST, "backbone=dit", "routing=sprint_finetune", "trainer.max_steps=3", f"run_dir={run}", "resume=true"))
    assert "routing.routes[0].selection_ratio: 0.75 -> 0.0 (SPRINT's second stage" in capsys.readouterr().out
    stage2.fit()
    assert stage2.backbone.router.routes[0].selection_ratio == 0.0 and [m.all() for m in stage2.backbone.router.last_masks] == [True]
