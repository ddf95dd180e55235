"""TREAD on diffusers' WanTransformer3DModel (video): a tiny random model built from a config.

The oracle of a route is diffusers' own blocks run per sample on the kept tokens, with a rotary table built from
the kept tokens' own (frame, row, column) coordinates; the same oracle with renumbered positions must fail, so the
test can tell a correct gather from a broken one. Single frames (t = 1, image mode) are tested throughout.
"""

from __future__ import annotations

import pytest
import torch

from backbones.adapters import adapt, add_lora, lora_parameters
from edm import FlowLoss
from routing import ConfigError, Route

B, TEXT, TEXT_DIM, C = 2, 5, 16, 4
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=C, out_channels=C, text_dim=TEXT_DIM,
            freq_dim=16, ffn_dim=32, num_layers=4, rope_max_seq_len=32)
# Image-to-video: image context through added K/V projections, condition latents concatenated along channels.
I2V = dict(TINY, in_channels=2 * C, image_dim=8, added_kv_proj_dim=TINY["num_attention_heads"] * TINY["attention_head_dim"])


def build(seed=0, **config):
    import diffusers

    torch.manual_seed(seed)
    return diffusers.WanTransformer3DModel(**{**TINY, **config})


def inputs(frames, height=8, width=12, seed=1, i2v=False):
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(B, C, frames, height, width, generator=g), torch.rand(B, generator=g)
    cond = {"encoder_hidden_states": torch.randn(B, TEXT, TEXT_DIM, generator=g)}
    if i2v:
        # diffusers' Wan attention takes the last 512 context tokens as text: pad the text to 512 as the pipeline does.
        cond["encoder_hidden_states"] = torch.randn(B, 512, TEXT_DIM, generator=g)
        cond["encoder_hidden_states_image"] = torch.randn(B, 3, 8, generator=g)
        cond["condition"] = torch.randn(B, C, frames, height, width, generator=g)
    return x, t, cond


def routed(policy="random", ratio=0.5, start=1, end=2, seed=5, model=None):
    net = adapt(model if model is not None else build(), policy=policy,
                routes=[{"selection_ratio": ratio, "start_layer_idx": start, "end_layer_idx": end}])
    net.router.generator = torch.Generator().manual_seed(seed)
    return net.train()


@pytest.mark.parametrize("frames", [1, 3])
@pytest.mark.parametrize("i2v", [False, True])
def test_routing_off_equals_the_diffusers_forward_bit_for_bit(frames, i2v):
    net = routed(ratio=0.0, model=build(**(I2V if i2v else {})))
    x, t, cond = inputs(frames, i2v=i2v)
    reference = net.reference(x, t, cond)
    assert reference.shape == x.shape
    assert torch.equal(net(x, t, cond), reference)
    assert net.router.last_masks[0].all()
    net.router.routes = [Route(0.5, 1, 2)]
    assert not torch.allclose(net(x, t, cond), reference)
    assert torch.equal(net.eval()(x, t, cond), reference)  # TREAD routes only in training


def rope_rows(model, coords):
    """The rotary (cos, sin) rows of tokens at (frame, row, column) `coords` (k, 3), built from the model's frequency
    tables axis by axis, independently of the adapter's gather: (1, k, 1, Dh) each."""
    rope = model.rope
    split = [rope.t_dim, rope.h_dim, rope.w_dim]
    out = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        parts = table.split(split, dim=1)  # per axis (max_seq_len, dim)
        out.append(torch.cat([part[coords[:, i]] for i, part in enumerate(parts)], dim=1)[None, :, None])
    return tuple(out)


def route_oracle(net, x, t, cond, start, end, renumber=False):
    """Per sample: diffusers' blocks start..end on the kept tokens of the route's entry state, at the kept tokens'
    own positions (or at renumbered ones: the first k positions of the grid). Returns (exit state, oracle outputs)."""
    m = net.model
    seen = {}
    h1 = net.steps[start - 1].block.register_forward_hook(lambda mod, a, out: seen.__setitem__("entry", out))
    h2 = net.steps[end + 1].block.register_forward_pre_hook(lambda mod, args: seen.__setitem__("exit", args[0]))
    net(x, t, cond)
    h1.remove(), h2.remove()
    _, proj, text, _ = m.condition_embedder(t * 1000, cond["encoder_hidden_states"], None)
    proj = proj.unflatten(1, (6, -1))
    grid = net.last_grid
    mask = net.router.last_masks[0]
    outs = []
    for b in range(B):
        pos = mask[b].nonzero().squeeze(1)
        where = torch.arange(len(pos)) if renumber else pos
        coords = torch.stack([where // (grid[1] * grid[2]), where // grid[2] % grid[1], where % grid[2]], dim=1)
        hidden = seen["entry"][b : b + 1, pos]
        for step in net.steps[start : end + 1]:
            hidden = step.block(hidden, text[b : b + 1], proj[b : b + 1], rope_rows(m, coords))
        outs.append((pos, hidden[0]))
    return seen["exit"], outs


@pytest.mark.parametrize("frames", [1, 4])
@pytest.mark.parametrize("policy, ratio", [("random", 0.5), ("rows", 0.5), ("structured", 0.75)])
def test_a_route_equals_diffusers_blocks_on_the_kept_tokens_at_their_positions_and_renumbering_fails(frames, policy, ratio):
    net = routed(policy, ratio, start=1, end=2)
    x, t, cond = inputs(frames)
    exit_state, outs = route_oracle(net, x, t, cond, 1, 2)
    for b, (pos, expected) in enumerate(outs):
        assert 0 < len(pos) < exit_state.shape[1]
        torch.testing.assert_close(exit_state[b, pos], expected)
    # Tokens renumbered as the first k positions of the video (a rotary table made for k tokens) fail the oracle.
    net.router.generator = torch.Generator().manual_seed(5)
    exit_state, outs = route_oracle(net, x, t, cond, 1, 2, renumber=True)
    assert any(not torch.allclose(exit_state[b, pos], wrong, atol=1e-4) for b, (pos, wrong) in enumerate(outs))


@pytest.mark.parametrize("policy", ["random", "rows", "structured"])
def test_bypassing_video_tokens_leave_the_route_unchanged_and_the_subset_has_the_policy_layout(policy):
    net = routed(policy, 0.75 if policy == "structured" else 0.5, start=1, end=2)
    x, t, cond = inputs(4)
    seen = {}
    h1 = net.steps[0].block.register_forward_hook(lambda m, a, out: seen.__setitem__("entry", out))
    h2 = net.steps[3].block.register_forward_pre_hook(lambda m, args: seen.__setitem__("exit", args[0]))
    net(x, t, cond)
    h1.remove(), h2.remove()
    processed = net.router.last_masks[0]
    assert torch.equal(seen["exit"][~processed], seen["entry"][~processed])
    assert not torch.allclose(seen["exit"][processed], seen["entry"][processed])
    (masks,) = net.route_masks()
    assert masks.shape == (B, 4, 4, 6)  # (t, h, w) token grid
    if policy == "rows":
        per_frame = masks.sum((2, 3))
        assert (per_frame == per_frame[:, :1]).all(), "the same number of rows in every frame"
        assert (masks.all(-1) | ~masks.any(-1)).all(), "whole rows"
    if policy == "structured":  # 2 x 2 x 2 groups keep 2 tokens each
        groups = masks.view(B, 2, 2, 2, 2, 3, 2).sum((2, 4, 6))
        assert (groups == 2).all()


def test_force_keep_marks_latent_voxels_that_every_route_processes():
    net = routed("random", 0.75)
    x, t, cond = inputs(2)
    voxels = torch.zeros(B, 2, 8, 12, dtype=torch.bool)
    voxels[0, 1, 2:4, 10] = True  # -> token (frame 1, row 1, column 5)
    out = net(x, t, {**cond, "force_keep": voxels})
    assert out.shape == x.shape
    assert net.route_masks()[0][0, 1, 1, 5]
    with pytest.raises(ConfigError, match="per latent pixel"):
        net(x, t, {**cond, "force_keep": voxels[:, :, :4]})


def test_latents_that_do_not_split_into_patches_are_refused_in_one_sentence():
    net = routed()
    x, t, cond = inputs(1, height=9)
    with pytest.raises(ConfigError, match=r"height 9 \(patch 2\)") as err:
        net(x, t, cond)
    assert "\n" not in str(err.value)
    wide = routed(model=build(patch_size=(2, 2, 2)))
    with pytest.raises(ConfigError, match=r"frames 1 \(patch 2\)"):
        wide(*inputs(1))


def test_lora_and_gradient_checkpointing_train_the_routed_video_model():
    net = routed("structured", 0.75)
    spec = add_lora(net.model, rank=4)
    # Self-attention (attn1) and cross-attention (attn2) projections of every block.
    assert set(spec.targets) == {"to_q", "to_k", "to_v", "to_out.0"}
    assert sum(".lora_A" in n for n, _ in net.model.named_parameters()) == 4 * 2 * 4
    x, t, cond = inputs(3)
    noise = torch.randn_like(x)
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            net.model.enable_gradient_checkpointing()
        net.router.generator = torch.Generator().manual_seed(9)
        net.model.zero_grad()
        FlowLoss()(net, x, cond, t, noise).mean().backward()
        grads.append({n: p.grad.clone() for n, p in net.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == {n for n, p in net.model.named_parameters() if ".lora_" in n}
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n])
    assert lora_parameters(net.model)[0].requires_grad


def test_the_lora_export_loads_with_wan_pipeline_load_lora_weights(tmp_path):
    import diffusers

    from backbones.adapters import load_lora, save_lora

    model = build()
    add_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B" in name:
                p.normal_()  # B = 0 would make every adapter look alike
    save_lora(model, tmp_path / "lora")
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=diffusers.UniPCMultistepScheduler(),
                                 transformer=build())
    pipe.load_lora_weights(tmp_path / "lora")
    ours = build()
    load_lora(ours, tmp_path / "lora")
    x, t, cond = inputs(2)
    expected = model(x, t * 1000, cond["encoder_hidden_states"], return_dict=False)[0]
    assert torch.equal(pipe.transformer(x, t * 1000, cond["encoder_hidden_states"], return_dict=False)[0], expected)
    assert torch.equal(ours(x, t * 1000, cond["encoder_hidden_states"], return_dict=False)[0], expected)
    assert not torch.allclose(build()(x, t * 1000, cond["encoder_hidden_states"], return_dict=False)[0], expected)
