"""Representation alignment (docs/alignment.md): REPA against a hand computation with a random tiny timm ViT as the
encoder, the self-alignment teacher without gradient, the hidden-state capture on every family with and without
TREAD and SPRINT routes, the model unchanged by it, and every refusal in one sentence."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.models import save_for_hf
from torch import nn

from backbones import build_backbone
from backbones.align import Alignment, gather_tokens, sra_blocks, teacher_time
from backbones.capture import HiddenCapture
from conftest import compose_cfg
from edm import build_objective
from routing import ConfigError, Router, build_policy, resolve_routes
from train.metrics.alignment import build_alignment
from train.metrics.encoder import FrozenEncoder
from train.schema import check_config

TREAD = {"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 3}
SPRINT = {"selection_ratio": 0.75, "start_layer_idx": 2, "end_layer_idx": 3, "mode": "sprint", "path_drop": 0.0}
POLICY = {"dit": "random", "diffmoe": "random", "rwkv": "rows", "mamba": "rows"}  # scan families need a grid


def tiny(family="dit", route=None, policy=None, depth=6, seed=0):
    """A 16x16 one-channel model on a 4x4 token grid (patch 4), every weight non-zero so every block matters."""
    torch.manual_seed(seed)
    model = build_backbone(family, "tiny", input_size=16, in_channels=1, patch_size=4, num_classes=10, depth=depth, hidden_size=32)
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    if route is not None:
        name = "structured" if route.get("mode") == "sprint" else (policy or POLICY[family])
        model.attach_router(Router(build_policy(name), resolve_routes([route], depth)))
        for p in model.fusions.parameters():
            nn.init.normal_(p, std=0.05)
    return model.train()


def batch(b=3):
    g = torch.Generator().manual_seed(1)
    return torch.rand(b, 1, 16, 16, generator=g) * 2 - 1, torch.rand(b, generator=g) + 0.2, torch.tensor([1, 2, 3, 4][:b])


def stem(model, x, c_noise, labels):
    """Tokens and conditioning as the skeleton makes them: (B, N, D), (B, D)."""
    tokens = model.x_embedder(x) + model.pos_embed
    return tokens, model.t_embedder(c_noise) + model.y_embedder(labels, x.shape[0], x.device)


@pytest.fixture(scope="module")
def vit_file(tmp_path_factory):
    """A random vit_tiny_patch16_224 at 64 pixels (a 4x4 patch grid, the model's token grid), saved as safetensors."""
    torch.manual_seed(3)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    path = tmp_path_factory.mktemp("enc") / "vit.safetensors"
    save_file(vit.state_dict(), str(path))
    return vit, path


@pytest.fixture(scope="module")
def vit_folder(tmp_path_factory):
    """A smaller random ViT (patch 4 at 32 pixels: an 8x8 grid, pooled 2x2 onto the 4x4 token grid), as a timm folder."""
    torch.manual_seed(4)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=2)
    folder = tmp_path_factory.mktemp("enc") / "small"
    save_for_hf(vit.eval(), str(folder))
    return vit, folder


# REPA


@pytest.mark.parametrize("route", [None, TREAD], ids=["unrouted", "tread"])
def test_repa_loss_equals_a_hand_computation(vit_file, route):
    vit, path = vit_file
    model = tiny("dit", route, depth=5)
    encoder = FrozenEncoder.load("vit_tiny_patch16_224", str(path), 64, model.grid, dtype=torch.float32)
    layer = 2  # inside the route's blocks 2..3 when routed: its kept tokens only
    align = Alignment(model, "repa", layer, weight=0.5, width=24, target_dim=encoder.dim, targets=encoder)
    x, t, y = batch()
    model(x, t, y)
    loss = align(x)

    # By hand: the skeleton's stem and blocks 0..layer, the route's kept tokens from the recorded selection, the
    # encoder on [0, 1] pixels resized bicubically to 64 and normalised with the ViT's mean and std, its class token dropped.
    tokens, c = stem(model, x, t, y)
    for i in range(layer):
        tokens = model.blocks[i](tokens, c, model.grid)
    keep = model.router.policy.last.indices if route else torch.arange(16).expand(3, 16)
    h = model.blocks[layer](torch.stack([tokens[k, keep[k]] for k in range(3)]), c, None)
    pixels = F.interpolate(x.repeat(1, 3, 1, 1) / 2 + 0.5, size=(64, 64), mode="bicubic", align_corners=False)
    mean, std = torch.tensor(vit.pretrained_cfg["mean"]), torch.tensor(vit.pretrained_cfg["std"])
    with torch.no_grad():
        feats = vit.forward_features((pixels - mean[:, None, None]) / std[:, None, None])[:, 1:]  # (B, 1 + 16, C) -> (B, 16, C)
    target = torch.stack([feats[k, keep[k]] for k in range(3)])
    cos = F.cosine_similarity(align.projector(h), target, dim=-1)  # (B, K)
    assert keep.shape[1] == (8 if route else 16)
    torch.testing.assert_close(loss, -0.5 * cos.mean(), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert all(p.grad is not None for p in align.projector.parameters())
    assert model.blocks[layer].adaLN.proj[1].weight.grad is not None and model.blocks[layer + 1].adaLN.proj[1].weight.grad is None


def test_encoder_folder_pools_its_grid_and_bf16_stays_close(vit_folder):
    vit, folder = vit_folder
    x = batch()[0]
    exact = FrozenEncoder.load("unused: the folder names it", str(folder), 32, (4, 4), dtype=torch.float32)
    assert (exact.dim, exact.grid) == (48, (8, 8))
    with torch.no_grad():
        grid = vit.eval().forward_features(exact.preprocess(x))[:, 1:].transpose(1, 2).reshape(3, 48, 8, 8)
    pooled = grid.reshape(3, 48, 4, 2, 4, 2).mean((3, 5)).flatten(2).transpose(1, 2)  # 2x2 means: (B, C, 8, 8) -> (B, 16, C)
    torch.testing.assert_close(exact(x), pooled, rtol=1e-5, atol=1e-5)
    bf16 = FrozenEncoder.load("unused", str(folder), 32, (4, 4))  # the training default: bf16 autocast
    assert F.cosine_similarity(bf16(x), exact(x), dim=-1).min() > 0.99


def test_encoder_refusals(vit_file, tmp_path):
    _, path = vit_file
    with pytest.raises(ConfigError, match=r"align.input_size=48 gives the encoder a 3x3 patch grid, which does not pool onto the "
                                          r"model's 4x4 token grid .*align.input_size=64"):
        FrozenEncoder.load("vit_tiny_patch16_224", str(path), 48, (4, 4))
    with pytest.raises(ConfigError, match="align.weights='/no/such/file' does not exist; put vit_tiny_patch16_224's weights there"):
        FrozenEncoder.load("vit_tiny_patch16_224", "/no/such/file", 64, (4, 4))
    with pytest.raises(ConfigError, match="align.encoder='no_such_net' is not a timm model name"):
        FrozenEncoder.load("no_such_net", str(path), 64, (4, 4))
    with pytest.raises(ConfigError, match="does not hold vit_small_patch16_224's weights"):
        FrozenEncoder.load("vit_small_patch16_224", str(path), 64, (4, 4))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is a folder without config.json"):
        FrozenEncoder.load("vit_tiny_patch16_224", str(tmp_path / "empty"), 64, (4, 4))


def test_build_alignment_from_the_config(vit_file):
    _, path = vit_file
    model = tiny("dit")
    assert build_alignment(compose_cfg("run_dir=/tmp/unused"), model) is None
    cfg = compose_cfg("run_dir=/tmp/unused", "align=repa", f"align.weights={path}", "align.input_size=64", "align.encoder=vit_tiny_patch16_224",
                      "align.projector_width=16")
    check_config(cfg)
    align = build_alignment(cfg, model, encoder_dtype=torch.float32)
    assert (align.mode, align.layer, align.loss_name, align.projector[-1].out_features) == ("repa", 1, "cosine", 192)
    # align=self is SRA's: its blocks scaled to depth 8 (4 and 8 of 12, 8 and 20 of 28, 1-based -> 2 and 4 of 8, 0-based),
    # its head Linear(D, 2D) - SiLU - Linear(2D, D), smooth L1 at weight 0.04 (0.4 x 0.1, its DiT variant).
    selfish = build_alignment(compose_cfg("run_dir=/tmp/unused", "align=self"), tiny("dit", depth=8))
    assert (selfish.layer, selfish.teacher_layer, selfish.teacher, selfish.loss_name, selfish.weight) == (2, 4, "ema", "smooth_l1", 0.04)
    assert [type(m) for m in selfish.projector] == [nn.Linear, nn.SiLU, nn.Linear]
    assert (selfish.projector[0].in_features, selfish.projector[0].out_features, selfish.projector[2].out_features) == (32, 64, 32)
    assert [sra_blocks(d) for d in (2, 4, 6, 8, 12, 24, 28)] == [(0, 1), (1, 2), (1, 2), (2, 4), (3, 7), (6, 16), (7, 19)]
    repa_head = build_alignment(compose_cfg("run_dir=/tmp/unused", "align=self", "align.head=repa", "align.projector_width=16"), tiny("dit", depth=8))
    assert [m.out_features for m in repa_head.projector if isinstance(m, nn.Linear)] == [16, 16, 32]


# Self-alignment


def test_ema_teacher_gets_no_gradient_sees_every_token_and_stops_after_its_block():
    model = tiny("dit", TREAD, depth=5)
    ema = build_objective("edm").wrap(tiny("dit", TREAD, depth=5, seed=7)).eval()
    for p in ema.parameters():
        p.requires_grad_(True)  # even trainable, the teacher must get nothing
    objective = build_objective("edm")
    align = Alignment(model, "self", 1, width=16, teacher_layer=3, teacher="ema", teacher_gap=0.2)
    ran = []
    ema.model.blocks[4].register_forward_hook(lambda *a: ran.append(4))
    x, sigma, y = batch()
    noise = torch.randn_like(x)
    per_elem = objective.loss(build_objective("edm").wrap(model), x, y, sigma, noise)
    u = torch.tensor([0.0, 0.5, 1.0])
    loss = align(x, y, sigma, noise, objective=objective, ema=ema, u=u)
    (per_elem.mean() + loss).backward()
    assert all(p.grad is None for p in ema.parameters())
    assert all(p.grad is not None for p in align.projector.parameters()) and model.blocks[1].adaLN.proj[1].weight.grad is not None
    assert ran == []  # the teacher's forward stopped after block 3

    # By hand: the student's block-1 state (EDM's c_in x_noisy, c_noise = ln(sigma) / 4; before the route: every token),
    # the EMA's block-3 state at the lower noise, every token (no TREAD route in eval), SRA's smooth L1 (beta 0.05).
    for cap in align._teacher_captures.values():
        cap.detach()
    lower = teacher_time("edm", sigma, 0.2, u)
    scale = lambda s: (s**2 + 0.25).rsqrt()[:, None, None, None]  # noqa: E731  EDM's c_in with sigma_data 0.5
    with torch.no_grad():
        h1 = _manual(model, scale(sigma) * (x + noise * sigma[:, None, None, None]), sigma.log() / 4, y, 1)[0]
        h3 = _manual(ema.model, scale(lower) * (x + noise * lower[:, None, None, None]), lower.log() / 4, y, 3)[0]
        expected = 0.5 * F.smooth_l1_loss(align.projector(h1), h3, beta=0.05)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_diffmoe_ema_teacher_runs_the_training_path_and_reads_nothing_on_the_host():
    """DiffMoE's EMA teacher (eval mode) routes by capacity, as the model it teaches does in training: its block state
    equals a training-mode forward of the same network on the same tokens, with no host read, and leaves the teacher's
    thresholds as they were; its eval path (dynamic capacity from the untrained thresholds) would give another state."""
    from host_reads import HostReads

    model = tiny("diffmoe", TREAD, depth=5)
    ema = build_objective("edm").wrap(tiny("diffmoe", TREAD, depth=5, seed=7)).eval().requires_grad_(False)
    objective = build_objective("edm")
    align = Alignment(model, "self", 1, width=16, teacher_layer=3, teacher="ema")
    x, sigma, y = batch()
    noise, u = torch.randn_like(x), torch.tensor([0.0, 0.5, 1.0])
    buffers = {k: v.clone() for k, v in ema.named_buffers()}
    with HostReads() as reads:
        teacher = align.ema_teacher(ema, objective, x, y, sigma, noise, u)
    assert not reads.reads, reads.summary()
    assert all(torch.equal(buffers[k], v) for k, v in ema.named_buffers())

    def block_3(net, training: bool) -> torch.Tensor:
        """Block 3's state of a copy of `net` in training or eval mode, every token, at the teacher's noise level."""
        copy = build_objective("edm").wrap(tiny("diffmoe", TREAD, depth=5)).requires_grad_(False)
        copy.load_state_dict(net.state_dict())
        capture = HiddenCapture(copy.model.train(training), [3])
        with torch.no_grad(), copy.model.router.forced(0.0):
            objective.loss(copy, x, y, teacher_time("edm", sigma, 0.2, u), noise)
        return capture.hidden[3]

    assert torch.equal(teacher, block_3(ema, training=True))
    assert not torch.allclose(teacher, block_3(ema, training=False))


@pytest.mark.parametrize("teacher", ["online", pytest.param("ema", marks=pytest.mark.slow)])  # the same capture: ema is the slower
def test_alignment_under_whole_model_compile_compiles_once_over_three_steps(teacher):
    """trainer.compile=model with self-alignment: the capture's recording policy is in place before the first compiled
    forward, so no guard fails at step 2 and the model compiles once (dynamo's eager backend: the graphs, no codegen)."""
    import torch._dynamo

    from train.compiling import compile_network, compiled_graphs

    net = build_objective("edm").wrap(tiny("dit", TREAD, depth=5))
    ema = build_objective("edm").wrap(tiny("dit", TREAD, depth=5)).eval().requires_grad_(False)
    objective, router = build_objective("edm"), net.model.router
    align = Alignment(net.model, "self", 2, width=16, teacher_layer=3, teacher=teacher)
    torch._dynamo.reset()
    before = compiled_graphs()
    forward = compile_network(net, net.model, "model", backend="eager")
    g, graphs = torch.Generator().manual_seed(1), []
    try:
        for step in range(3):
            x, sigma, y = batch()
            noise = torch.randn(x.shape, generator=g)
            router.set_draws(torch.Generator().manual_seed(100 + step), 0, len(x))  # the routes drawn outside the graph
            loss = objective.loss(forward, x, y, sigma, noise).mean()
            (loss + align(x, y, sigma, noise, objective=objective, ema=ema, u=torch.rand(len(x), generator=g))).backward()
            graphs.append(compiled_graphs() - before)
            torch._dynamo.config.error_on_recompile = True  # from the second step on, a recompile fails the test
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert graphs == [graphs[0]] * 3 and graphs[0] >= 1, graphs


def test_teacher_time_is_lower_and_in_range():
    t = torch.tensor([0.05, 0.5, 0.99])
    u = torch.tensor([1.0, 0.5, 0.0])
    torch.testing.assert_close(teacher_time("flow", t, 0.2, u), torch.tensor([0.0, 0.4, 0.99]))
    sigma = torch.tensor([0.01, 1.0, 80.0, 0.001])
    lower = teacher_time("edm", sigma, 0.2, torch.tensor([1.0, 0.5, 0.0, 1.0]))
    assert (lower <= sigma * (1 + 1e-5)).all() and (lower >= 0.001 * (1 - 1e-5)).all() and lower[0] >= 0.002 * (1 - 1e-5)
    torch.testing.assert_close(lower[1], torch.tensor(0.4 / 0.6))  # sigma 1 is flow time 0.5; 0.5 - 0.1 = 0.4 -> 0.4 / 0.6


def test_online_teacher_is_detached_in_the_same_route():
    model = tiny("dit", TREAD, depth=6)
    align = Alignment(model, "self", 2, width=16, teacher_layer=3, teacher="online", loss="cosine")
    x, t, y = batch()
    model(x, t, y)
    held = align.capture.positions[3]
    assert held is not None and held is align.capture.positions[2]  # both hold the route's kept tokens, in one order
    align(x).backward()
    assert model.blocks[2].adaLN.proj[1].weight.grad is not None
    assert model.blocks[3].adaLN.proj[1].weight.grad is None  # the teacher's block gets no gradient from the alignment


# The trainer's calls (docs/alignment.md), in process: every family x {none, TREAD, SPRINT} x {repa, self}


@pytest.mark.parametrize("recipe", [None, TREAD, SPRINT], ids=["none", "tread", "sprint"])
@pytest.mark.parametrize("family", ["dit", "rwkv", "mamba", "diffmoe"])
def test_two_steps_as_the_trainer_will_call_it(vit_file, family, recipe):
    from timm.utils import ModelEmaV3

    from backbones.diffmoe import auxiliary_losses

    x, _, labels = batch()
    for mode, name in (("repa", "edm"), ("self", "flow")):
        objective = build_objective(name)
        net = objective.wrap(tiny(family, recipe, depth=5))
        backbone = net.model
        targets = FrozenEncoder.load("vit_tiny_patch16_224", str(vit_file[1]), 64, backbone.grid) if mode == "repa" else None
        align = Alignment(backbone, mode, 1, width=16, target_dim=targets.dim if targets else None, targets=targets, teacher_layer=3)
        ema = ModelEmaV3(net, decay=0.9)  # the EMA copy after the hooks: its copies stay inert
        optimizer = torch.optim.AdamW(list(net.parameters()) + list(align.parameters()), lr=1e-3)
        before = [p.detach().clone() for p in align.parameters()]
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            t, noise, u = objective.sample_time(3, g), torch.randn(x.shape, generator=g), torch.rand(3, generator=g)
            backbone.router.generator = g
            per_elem = objective.loss(net, x, labels, t, noise)
            aux = auxiliary_losses(net)
            loss = per_elem.mean() + sum(aux.values()) + align(x, labels, t, noise, objective=objective, ema=ema.module, u=u)
            assert torch.isfinite(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ema.update(net, step=step)
        assert all(not torch.equal(a, b) for a, b in zip(align.parameters(), before))
        assert set(ema.module.state_dict()) == set(net.state_dict())  # no projector in the EMA or an export


# Capture on every family


def _manual(model, x, t, y, upto):
    tokens, c = stem(model, x, t, y)
    for i in range(upto + 1):
        tokens = model.blocks[i](tokens, c, model.grid)
    return tokens, c


@pytest.mark.parametrize("family", ["dit", "rwkv", "mamba", "diffmoe"])
def test_capture_on_every_family_with_no_route_tread_and_sprint(family):
    x, t, y = batch()
    # No route: the full sequence after block 2, as the blocks compute it by hand.
    model = tiny(family, depth=5)
    cap = HiddenCapture(model, [2])
    out = model(x, t, y)
    torch.testing.assert_close(cap.hidden[2], _manual(model, x, t, y, 2)[0])
    assert cap.positions[2] is None
    cap.detach()
    assert torch.equal(model(x, t, y), out)

    # TREAD (blocks 2..3): before the route all tokens; inside, the kept ones in the policy's order; after, all again.
    model = tiny(family, TREAD, depth=5)
    cap = HiddenCapture(model, [1, 2, 3, 4])
    model(x, t, y)
    before, c = _manual(model, x, t, y, 1)
    torch.testing.assert_close(cap.hidden[1], before)
    keep, sel = cap.positions[2], model.router.policy.last
    assert cap.positions[1] is None and keep.shape == (3, 8) and cap.positions[3] is keep and cap.positions[4] is None
    sub = model.blocks[2](gather_tokens(before, keep), c, sel.grid)
    torch.testing.assert_close(cap.hidden[2], sub)
    rejoined = before.scatter(1, keep[:, :, None].expand(-1, -1, 32), model.blocks[3](sub, c, sel.grid))
    torch.testing.assert_close(cap.hidden[4], model.blocks[4](rejoined, c, model.grid))

    # SPRINT (blocks 2..3 sparse, structured): the dense encoder all tokens, the sparse middle its kept quarter.
    model = tiny(family, SPRINT, depth=5)
    cap = HiddenCapture(model, [1, 3, 4])
    model(x, t, y)
    before, c = _manual(model, x, t, y, 1)
    torch.testing.assert_close(cap.hidden[1], before)
    keep, sel = cap.positions[3], model.router.policy.last
    assert keep.shape == (3, 4) and cap.positions[4] is None and cap.hidden[4].shape == (3, 16, 32)
    torch.testing.assert_close(cap.hidden[3], model.blocks[3](model.blocks[2](gather_tokens(before, keep), c, sel.grid), c, sel.grid))
    model.eval()  # inference runs the SPRINT middle with every token: all of them, raster order
    model(x, t, y)
    assert cap.positions[3] is None and cap.hidden[3].shape == (3, 16, 32)


def test_capture_changes_no_output_and_adds_no_weight():
    """Alignment off gives today's losses bit for bit; on, the model's own outputs and weights are unchanged."""
    x, t, y = batch()
    plain, hooked = tiny("dit", TREAD), tiny("dit", TREAD)
    keys = list(hooked.state_dict())
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    plain.router.generator, hooked.router.generator = g1, g2
    Alignment(hooked, "self", 1, width=8, teacher_layer=4, teacher="online")
    assert torch.equal(plain(x, t, y), hooked(x, t, y))
    assert list(hooked.state_dict()) == keys  # the projector lives in the Alignment, never in the model or its exports


def test_a_deep_copy_of_the_hooked_model_captures_nothing():
    """The EMA is a deep copy of the network: its forwards (teacher, previews) leave the online capture alone."""
    import copy

    x, t, y = batch()
    model = tiny("dit", TREAD)
    align = Alignment(model, "self", 1, width=8, teacher_layer=4, teacher="online")
    ema = copy.deepcopy(model).eval()
    model(x, t, y)
    held = dict(align.capture.hidden)
    ema(x, t + 1, y)
    assert align.capture.hidden == held and align.capture.hidden[1] is held[1]
    assert torch.equal(ema(x, t, y), model.eval()(x, t, y))


@pytest.mark.slow
@pytest.mark.parametrize("whole", [False, True], ids=["blocks", "model"])
def test_capture_under_torch_compile(whole):
    """trainer.compile=blocks compiles each block in place, =model the whole network; the hooks are traced with them
    (aot_eager: dynamo and autograd tracing without a C++ compiler, so it runs on the CPU)."""
    x, t, y = batch()
    eager, compiled = tiny("dit", TREAD, depth=5), tiny("dit", TREAD, depth=5)
    aligns = [Alignment(m, "self", 2, width=8, teacher_layer=3, teacher="online", loss="cosine") for m in (eager, compiled)]
    aligns[1].load_state_dict(aligns[0].state_dict())
    if whole:
        run = torch.compile(compiled, backend="aot_eager", dynamic=False)
    else:
        for block in compiled.blocks:
            block.compile(backend="aot_eager", dynamic=False)
        run = compiled
    losses = []
    for model, forward, align in ((eager, eager, aligns[0]), (compiled, run, aligns[1])):
        model.router.generator = torch.Generator().manual_seed(0)
        forward(x, t, y)
        assert align.capture.positions[2].shape == (3, 8)
        losses.append(align(x))
        losses[-1].backward()
        assert model.blocks[2].adaLN.proj[1].weight.grad is not None
    torch.testing.assert_close(losses[1], losses[0])


def test_capture_under_gradient_checkpointing_keeps_the_forward_state():
    x, t, y = batch()
    model = tiny("dit", TREAD)
    model.router.checkpointing = True
    align = Alignment(model, "self", 2, width=8, teacher_layer=3, teacher="online", loss="cosine")
    model(x, t, y).square().mean().backward()  # the recompute in backward runs the hooks again
    model.zero_grad()
    out = model(x, t, y)
    loss = align(x)
    (out.square().mean() + loss).backward()
    assert model.blocks[2].adaLN.proj[1].weight.grad is not None


# Refusals, one sentence each


@pytest.mark.parametrize("overrides, message", [
    (["align.weight=-0.5"], r"align.weight=-0.5 is out of range; it must be >= 0 \(e.g. align.weight=0.5\)"),
    (["align=self", "align.layer=8"], r"align.layer=8 is outside the model's 8 blocks; use an index in \[-8, 7\]"),
    (["align=self", "align.teacher_layer=1"], r"align.teacher_layer=1 \(block 1\) is not after align.layer=2"),
    (["align=self", "routing=random", "align.teacher=online", "align.layer=1", "align.teacher_layer=3"],
     r"align.teacher_layer=3 \(block 3\) lies in route r2->4, which holds only its kept tokens, but align.layer=1 \(block 1\) is "
     r"outside every route, so the online teacher cannot see every token the student aligns"),
    (["align=self", "routing=sprint", "align.teacher=online", "align.layer=2", "align.teacher_layer=6"], None),
    (["align=self", "routing=sprint_finetune", "align.teacher=online", "align.teacher_layer=3"], None),
    (["align=self", "routing=random", "align.teacher_layer=3"], None),  # the EMA teacher runs every token
    (["align=self", "trainer.distributed=fsdp"], None),  # the EMA teacher runs a sharded copy (tests/test_fsdp.py)
    (["align=self", "trainer.distributed=fsdp", "align.teacher=online", "align.teacher_layer=-1"], None),
    (["align=repa"], r"align=repa needs align.weights, local weights of vit_base_patch14_dinov2.lvd142m \(nothing is downloaded\)"),
    (["align=repa", "align.weights=/no/dinov2.safetensors"], r"align.weights='/no/dinov2.safetensors' does not exist; put the encoder's"),
    (["align=repa", "data=latents", "data.path=/tmp"], None),  # the folder's meta.json decides (tests/test_align_latents.py)
    (["align=self", "+experiment=finetune_dit", "finetune.pretrained=/tmp"], r"align=self aligns the blocks of our own backbones"),
    (["align=other"], r"align"),
])
def test_config_refusals(overrides, message):
    if message is None:
        check_config(compose_cfg("run_dir=/tmp/unused", *overrides))
        return
    try:
        cfg = compose_cfg("run_dir=/tmp/unused", *overrides)
    except Exception as err:  # an unknown group option is refused by Hydra while composing
        assert "align" in str(err)
        return
    with pytest.raises(ConfigError, match=message) as err:
        check_config(cfg)
    assert "\n" not in str(err.value)
