"""TREAD on pretrained diffusers transformers: tiny random models of each family, built offline from configs."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from backbones.adapters import FAMILIES, add_lora, adapt, load_lora, load_pretrained, lora_parameters, lora_state_dict, save_lora
from backbones.adapters.flux import PerSampleRopeProcessor
from edm import FlowLoss
from routing import ConfigError, ForceKeep, Route, Router, build_policy
from routing.policy import POLICIES

B = 2
TEXT = 5  # text tokens
SIZE, GRID = (12, 12), (6, 6)  # latent pixels, tokens (patch 2; diffusers' own DiT forward needs a square)
N = GRID[0] * GRID[1]

# Tiny configs: 4-5 blocks, 2 heads of 8-16 channels, 4 latent channels.
CONFIGS = {
    "flux": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, axes_dims_rope=(4, 6, 6)),
    "sd3": dict(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=2,
                joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=12, out_channels=4,
                pos_embed_max_size=16, dual_attention_layers=(1,), qk_norm="rms_norm"),
    "pixart": dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=4,
                   cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=24),
    "dit": dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=4,
                sample_size=8, patch_size=2, num_embeds_ada_norm=10),
}


def build(family: str, seed: int = 0):
    import diffusers

    torch.manual_seed(seed)
    return getattr(diffusers, FAMILIES[family].model_class)(**CONFIGS[family])


def inputs(family: str, seed: int = 1, size=SIZE):
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(B, 4, *size, generator=g), torch.rand(B, generator=g)
    if family == "dit":
        return x, t, torch.tensor([3, 7])
    cond = {"encoder_hidden_states": torch.randn(B, TEXT, 24, generator=g)}
    if family in ("flux", "sd3"):
        cond["pooled_projections"] = torch.randn(B, 12, generator=g)
    if family == "pixart":
        cond["encoder_attention_mask"] = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    return x, t, cond


def call(net, x, t, cond, reference=False, **kw):
    torch.manual_seed(123)  # DiT's label dropout draws from the global RNG in training mode
    return (net.reference if reference else net)(x, t, cond, **kw)


def routed(family, ratio=0.5, start=1, end=2, policy="random", seed=5):
    net = adapt(build(family), policy=policy, routes=[{"selection_ratio": ratio, "start_layer_idx": start, "end_layer_idx": end}])
    net.router.generator = torch.Generator().manual_seed(seed)
    return net.train()


def image_of(block_out):
    return block_out[1] if isinstance(block_out, tuple) else block_out  # joint blocks return (text, image)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_ratio_zero_and_eval_mode_equal_the_unrouted_model(family):
    net = routed(family, ratio=0.0, start=1, end=-2)
    if family != "dit":  # a non-square latent too
        x, t, cond = inputs(family, size=(8, 12))
        assert torch.equal(call(net, x, t, cond), call(net, x, t, cond, reference=True))
    x, t, cond = inputs(family)
    reference = call(net, x, t, cond, reference=True)
    assert reference.shape == x.shape
    assert torch.equal(call(net, x, t, cond), reference)
    assert net.router.last_masks[0].all()
    net.router.routes = [Route(0.5, 1, 2)]
    assert not torch.allclose(call(net, x, t, cond), reference)
    net.eval()  # TREAD routes only in training
    assert torch.equal(call(net, x, t, cond), call(net, x, t, cond, reference=True))


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("policy", ["random", "rows"])
def test_bypassing_image_tokens_leave_the_route_exactly_as_they_entered(family, policy):
    net = routed(family, policy=policy, start=1, end=2)
    seen = {}
    first, after = net.steps[0].block, net.steps[3].block
    h1 = first.register_forward_hook(lambda m, a, out: seen.__setitem__("entry", image_of(out)))
    h2 = after.register_forward_pre_hook(lambda m, args: seen.__setitem__("exit", args[0]))
    call(net, *inputs(family))
    h1.remove(), h2.remove()
    processed = net.router.last_masks[0]
    assert 0 < processed[0].sum() < processed.shape[1]
    assert torch.equal(seen["exit"][~processed], seen["entry"][~processed])
    assert not torch.allclose(seen["exit"][processed], seen["entry"][processed])
    if policy == "rows":  # the image-token grid is kept: whole rows of the token grid
        rows = processed.view(B, *GRID)
        assert (rows.all(-1) | ~rows.any(-1)).all()


def _attention_inputs(net):
    """Record hidden/text lengths and the rotary table at every attention call of the model."""
    calls = []

    def hook(module, args, kwargs):
        calls.append({k: kwargs.get(k) for k in ("hidden_states", "encoder_hidden_states", "image_rotary_emb")} | {"module": module})

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for n, m in net.model.named_modules() if n.endswith(".attn")]
    return calls, handles


def test_flux_text_tokens_are_never_dropped():
    net = routed("flux", start=1, end=3)  # double block 1, single blocks 2 and 3
    calls, handles = _attention_inputs(net)
    call(net, *inputs("flux"))
    [h.remove() for h in handles]
    k = int(net.router.last_masks[0][0].sum())
    n = net.router.last_masks[0].shape[1]
    assert k < n
    double, single = calls[:2], calls[2:]
    assert [c["hidden_states"].shape[1] for c in double] == [n, k]
    assert all(c["encoder_hidden_states"].shape[1] == TEXT for c in double)
    # Single-stream blocks attend over [text, image]: all text tokens plus the kept image tokens.
    assert [c["hidden_states"].shape[1] for c in single] == [TEXT + k, TEXT + k, TEXT + n]


def test_sd3_and_pixart_keep_the_whole_context_inside_a_route():
    for family in ("sd3", "pixart"):
        net = routed(family, start=1, end=2)
        seen = []
        handles = [s.block.register_forward_pre_hook(lambda m, args: seen.append((args[0].shape[1], args[1 if family == "sd3" else 2].shape[1])))
                   for s in net.steps]
        call(net, *inputs(family))
        [h.remove() for h in handles]
        k, n = int(net.router.last_masks[0][0].sum()), N
        assert seen == [(n, TEXT), (k, TEXT), (k, TEXT), (n, TEXT)]


@pytest.mark.parametrize("policy", ["random", "rows", "l1norm"])
def test_flux_kept_token_sees_the_rotary_embedding_of_its_original_position(policy):
    net = routed("flux", policy=policy, start=1, end=3)
    x, t, cond = inputs("flux")
    calls, handles = _attention_inputs(net)
    call(net, x, t, cond)
    [h.remove() for h in handles]
    mask = net.router.last_masks[0]
    ids = torch.cat([torch.zeros(TEXT, 3), _ids(*GRID)])
    full_cos, full_sin = net.model.pos_embed(ids)  # (L + N, Dh): the unrouted table
    for c in calls[1:4]:  # the three attentions inside the route
        cos, sin = c["image_rotary_emb"]
        assert cos.shape[0] == B
        for b in range(B):
            pos = mask[b].nonzero().squeeze(1)
            assert torch.equal(cos[b, :TEXT], full_cos[:TEXT]) and torch.equal(sin[b, :TEXT], full_sin[:TEXT])
            assert torch.equal(cos[b, TEXT:], full_cos[TEXT + pos]) and torch.equal(sin[b, TEXT:], full_sin[TEXT + pos])


def _ids(h, w):
    from backbones.adapters.flux import image_ids

    return image_ids(h, w, "cpu")


def test_flux_route_equals_diffusers_blocks_run_on_the_kept_tokens_at_their_positions():
    """Oracle: per sample, diffusers' own blocks on the kept tokens with the kept tokens' position ids."""
    net = routed("flux", start=1, end=3)
    m = net.model
    x, t, cond = inputs("flux")
    seen = {}
    h1 = net.steps[0].block.register_forward_hook(lambda mod, a, out: seen.__setitem__("after0", out))
    h2 = net.steps[4].block.register_forward_pre_hook(lambda mod, args: seen.__setitem__("exit", args))
    call(net, x, t, cond)
    h1.remove(), h2.remove()
    text0, image0 = seen["after0"]
    temb = m.time_text_embed(t * 1000, cond["pooled_projections"])
    mask = net.router.last_masks[0]
    for b in range(B):
        pos = mask[b].nonzero().squeeze(1)
        rotary = m.pos_embed(torch.cat([torch.zeros(TEXT, 3), _ids(*GRID)[pos]]))  # the kept tokens' own ids
        text, image = text0[b : b + 1], image0[b : b + 1, pos]
        for step in net.steps[1:4]:
            text, image = step.block(hidden_states=image, encoder_hidden_states=text, temb=temb[b : b + 1], image_rotary_emb=rotary)
        torch.testing.assert_close(seen["exit"][0][b, pos], image[0])
        torch.testing.assert_close(seen["exit"][1][b], text[0])


def test_per_sample_rope_processor_matches_diffusers_attention():
    m = build("flux")
    for attn in (m.transformer_blocks[0].attn, m.single_transformer_blocks[0].attn):
        g = torch.Generator().manual_seed(0)
        hidden, text = torch.randn(B, 7, 32, generator=g), torch.randn(B, TEXT, 32, generator=g)
        cos, sin = m.pos_embed(torch.randn(7 + TEXT, 3, generator=g) * 4)
        joint = attn.added_kv_proj_dim is not None
        if not joint:
            hidden = torch.cat([text, hidden], 1)
        args = (hidden, text if joint else None, None)
        expected = attn.processor(attn, *args, (cos, sin))
        got = PerSampleRopeProcessor(attn.processor)(attn, *args, (cos.expand(B, -1, -1), sin.expand(B, -1, -1)))
        for e, o in zip(expected if joint else [expected], got if joint else [got]):
            torch.testing.assert_close(o, e)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_force_keep_tokens_are_always_processed(family, policy):
    net = routed(family, policy=policy, ratio=0.75, start=1, end=2)
    net.router.routes = [Route(0.75, 0, 1), Route(0.5, 2, 3)]
    x, t, cond = inputs(family)
    pixels = torch.zeros(B, *SIZE, dtype=torch.bool)
    pixels[0, 1:3, 9:12] = True  # latent pixels -> tokens (0, 4), (0, 5), (1, 4), (1, 5) of the 6x6 grid
    pixels[1, 6, 0] = True  # -> token (3, 0)
    tokens = torch.zeros(B, N, dtype=torch.bool)
    tokens[0, [4, 5, 10, 11]] = True
    tokens[1, 18] = True
    # Bare or as a ForceKeep (its host copy pooled alike), per latent pixel or per token.
    for mask in (pixels, tokens, ForceKeep.of(pixels), ForceKeep.of(tokens)):
        if isinstance(cond, dict):
            out = call(net, x, t, {**cond, "force_keep": mask})
        else:
            out = call(net, x, t, cond, force_keep=mask)
        assert out.shape == x.shape
        for processed in net.router.last_masks:
            assert processed[tokens].all()
            if policy != "none":
                assert not processed.all()


@pytest.mark.parametrize("form", ["tokens", "pixels"])
def test_a_force_keep_mask_of_another_batch_or_not_bool_is_refused_in_one_sentence(form):
    """Through an adapted model's forward (force_keep in its conditioning): a mask with 3 rows for 2 samples, or a float
    mask (which .bool() turned into all-forced for every non-zero weight), is refused as select refuses it."""
    net = routed("flux", policy="random", ratio=0.5, start=1, end=2)
    x, t, cond = inputs("flux")
    shape = (N,) if form == "tokens" else SIZE
    cases = ((torch.zeros(B + 1, *shape, dtype=torch.bool), f"force_keep has {B + 1} rows but the batch has {B}"),
             (torch.full((B, *shape), 0.3), "force_keep must be a bool mask, got torch.float32"))
    for mask, said in cases:
        for keep in (mask, ForceKeep.of(mask)):
            with pytest.raises(ConfigError, match=said):
                call(net, x, t, {**cond, "force_keep": keep})
            with pytest.raises(ConfigError, match=said):
                call(net, x, t, cond, force_keep=keep)


def test_adapter_output_feeds_flow_loss_and_gradient_checkpointing_matches():
    net = routed("flux", start=1, end=3)
    x, t, cond = inputs("flux")
    noise = torch.randn_like(x)
    net.router.generator = torch.Generator().manual_seed(9)
    FlowLoss()(net, x, cond, t, noise).mean().backward()
    grads = {n: p.grad.clone() for n, p in net.model.named_parameters()}
    net.model.zero_grad()
    net.model.enable_gradient_checkpointing()
    net.router.generator = torch.Generator().manual_seed(9)
    FlowLoss()(net, x, cond, t, noise).mean().backward()
    for n, p in net.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n])


def test_fp32_after_route_keeps_the_text_stream():
    net = adapt(build("flux"), Router(build_policy("random"), [Route(0.0, 1, 2)], fp32_after_route=True)).train()
    x, t, cond = inputs("flux")
    torch.testing.assert_close(net(x, t, cond), net.reference(x, t, cond))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_lora_trains_only_the_adapters_and_leaves_base_weights_unchanged(family):
    net = routed(family, start=1, end=2)
    x, t, cond = inputs(family)
    before = call(net, x, t, cond, reference=True)
    spec = add_lora(net.model, rank=4)
    assert torch.equal(call(net, x, t, cond, reference=True), before), "LoRA starts with B = 0: the model is unchanged"
    expected = {"to_q", "to_k", "to_v", "to_out.0"} | ({"add_q_proj", "add_k_proj", "add_v_proj"} if family in ("flux", "sd3") else set())
    assert expected <= set(spec.targets)
    base = {n: p.detach().clone() for n, p in net.model.named_parameters() if ".lora_" not in n}
    lora = lora_parameters(net.model)
    assert lora and all(p.requires_grad for p in lora)
    assert not any(p.requires_grad for n, p in net.model.named_parameters() if ".lora_" not in n)
    # SD3's last block discards its context queries, so LoRA on its add_q_proj gets no gradient (nor would the base).
    live = [(n, p) for n, p in net.model.named_parameters()
            if ".lora_" in n and not (family == "sd3" and n.startswith("transformer_blocks.3.attn.add_q_proj."))]
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    for step in range(2):
        optimizer.zero_grad()
        torch.manual_seed(0)
        FlowLoss()(net, x, cond, t, torch.randn_like(x)).mean().backward()
        assert all(p.grad is not None for p in lora)
        for n, p in live:  # B starts at zero, so A's gradient is zero until the first step moved B
            if step == 1 or ".lora_B" in n:
                assert p.grad.abs().sum() > 0, n
        optimizer.step()
    for n, p in net.model.named_parameters():
        if ".lora_" not in n:
            assert p.grad is None and torch.equal(p, base[n]), n


def test_adapter_only_checkpoint_round_trips_exactly(tmp_path):
    net = routed("flux", start=1, end=3)
    add_lora(net.model, rank=4, alpha=8)
    x, t, cond = inputs("flux")
    optimizer = torch.optim.AdamW(lora_parameters(net.model), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        FlowLoss()(net, x, cond, t, torch.randn_like(x)).mean().backward()
        optimizer.step()
    save_lora(net.model, tmp_path / "lora")
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                                     "pytorch_lora_weights.safetensors", "tread_zoo_lora.json"]
    saved = lora_state_dict(net.model)
    assert all(".lora_" in k for k in saved)

    fresh = adapt(build("flux"), policy="random", routes=[{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 3}]).eval()
    spec = load_lora(fresh.model, tmp_path / "lora")
    assert spec.rank == 4 and spec.alpha == 8
    restored = lora_state_dict(fresh.model)
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)
    assert torch.equal(fresh(x, t, cond), net.eval()(x, t, cond))

    other = build("flux")
    other.register_to_config(num_single_layers=4)
    with pytest.raises(ConfigError, match=r"config differs in num_single_layers: 3 -> 4; load that model"):
        load_lora(other, tmp_path / "lora")
    with pytest.raises(ConfigError, match="trained on a FluxTransformer2DModel, not a DiTTransformer2DModel"):
        load_lora(build("dit"), tmp_path / "lora")


def test_pretrained_loads_from_a_local_folder_and_a_missing_one_says_what_to_fetch(tmp_path):
    model = build("flux")
    model.save_pretrained(tmp_path / "pipe" / "transformer")
    for path in (tmp_path / "pipe", tmp_path / "pipe" / "transformer"):
        loaded = load_pretrained("flux", path)
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ConfigError, match=r"huggingface-cli download black-forest-labs/FLUX.1-dev") as err:
        load_pretrained("flux", tmp_path / "missing")
    assert "\n" not in str(err.value) and str(err.value).endswith(".")
    with pytest.raises(ConfigError, match="holds a FluxTransformer2DModel, not the DiTTransformer2DModel"):
        load_pretrained("dit", tmp_path / "pipe")


def test_a_pretrained_folder_with_config_json_but_no_weights_says_what_to_fetch(tmp_path):
    """A download of config.json alone: one sentence naming the folder and the weights to fetch, before diffusers'
    warning and its OSError ("no file named diffusion_pytorch_model.safetensors")."""
    build("flux").save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    for path in (tmp_path / "pipe", tmp_path / "pipe" / "transformer"):
        with pytest.raises(ConfigError, match=r"transformer' holds the FluxTransformer2DModel's config.json but no "
                                              r"weights \(diffusion_pytorch_model.safetensors, ") as err:
            load_pretrained("flux", path)
        fetch = f"--include 'transformer/*' --local-dir {tmp_path / 'pipe'}`."
        assert "\n" not in str(err.value) and fetch in str(err.value)


def test_adapt_refuses_unknown_models_and_bad_routes():
    with pytest.raises(ConfigError, match="no TREAD adapter for Linear"):
        adapt(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="outside the model's 5 blocks"):
        adapt(build("flux"), policy="random", routes=[{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 5}])
    assert copy.deepcopy(routed("sd3")).depth == 4


def test_the_documented_tiny_flux_fine_tuning_runs_end_to_end(tmp_path):
    import runpy

    script = runpy.run_path(str(Path(__file__).parents[1] / "docs" / "figures" / "finetune_tiny_flux.py"))
    losses = script["main"](["--steps", "2", "--batch", "2", "--out", str(tmp_path)])
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    # A second run into the same folder would write a new random base over the one the first LoRA was trained on.
    written = (tmp_path / "pretrained" / "config.json").read_bytes()
    with pytest.raises(SystemExit) as stop:
        script["main"](["--steps", "2", "--out", str(tmp_path)])
    assert stop.value.code == 2 and (tmp_path / "pretrained" / "config.json").read_bytes() == written


@pytest.mark.parametrize("family", ["pixart", "dit"])
def test_families_without_a_diffusers_lora_loader_export_the_same_format(family, tmp_path):
    from safetensors import safe_open

    model = build(family)
    add_lora(model, rank=2, alpha=4, targets="attention_mlp")
    for p in lora_parameters(model):
        torch.nn.init.normal_(p)
    save_lora(model, tmp_path / "lora")
    with safe_open(tmp_path / "lora" / "pytorch_lora_weights.safetensors", framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert keys == {f"transformer.{k}" for k in lora_state_dict(model)}
    assert '"transformer.lora_alpha": 4' in meta["lora_adapter_metadata"]
    fresh = build(family)
    load_lora(fresh, tmp_path / "lora")
    x, t, cond = inputs(family)
    assert torch.equal(call(adapt(fresh).eval(), x, t, cond), call(adapt(model).eval(), x, t, cond))


def test_an_adapter_folder_of_the_previous_format_still_loads(tmp_path):
    """lora/ as runs wrote it before the diffusers pipeline format: adapter_model.safetensors with unprefixed peft keys."""
    import json

    from safetensors.torch import save_file

    from backbones.adapters import model_config

    model = build("flux")
    add_lora(model, rank=4, alpha=8)
    for p in lora_parameters(model):
        torch.nn.init.normal_(p)
    folder = tmp_path / "old"
    folder.mkdir()
    save_file(lora_state_dict(model), folder / "adapter_model.safetensors", metadata={"format": "tread-zoo-lora/1"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "format": "tread-zoo-lora/1",
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                                                   "add_v_proj", "to_add_out"]},
        "model": {"class": "FluxTransformer2DModel", "config": model_config(model)},
    }))
    fresh = build("flux")
    assert load_lora(fresh, folder).alpha == 8
    x, t, cond = inputs("flux")
    assert torch.equal(call(adapt(fresh).eval(), x, t, cond), call(adapt(model).eval(), x, t, cond))


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_ip_adapter_inputs_are_refused_in_one_sentence(family, ratio):
    net = routed(family, ratio=ratio)
    x, t, cond = inputs(family)
    cond["joint_attention_kwargs"] = {"ip_adapter_image_embeds": [torch.randn(B, 4)]}
    for run in (net, net.reference):
        with pytest.raises(ConfigError, match=r"IP-adapter inputs \(joint_attention_kwargs\['ip_adapter_image_embeds'\]\)") as err:
            run(x, t, cond)
        assert "\n" not in str(err.value)


def test_routed_flux_attention_goes_through_the_models_attention_backend(monkeypatch):
    from diffusers.models import attention_dispatch

    net = routed("flux", ratio=0.5, start=0, end=3)
    net.model.set_attention_backend("_native_math")
    seen = []
    dispatch = attention_dispatch.dispatch_attention_fn

    def spy(*args, backend=None, **kwargs):
        seen.append((args[0].shape[1], str(backend)))
        return dispatch(*args, backend=backend, **kwargs)

    monkeypatch.setattr(attention_dispatch, "dispatch_attention_fn", spy)  # what the routed path calls
    monkeypatch.setattr("diffusers.models.transformers.transformer_flux.dispatch_attention_fn", spy)  # the model's own
    x, t, cond = inputs("flux")
    routed_out = call(net, x, t, cond)
    assert torch.isfinite(routed_out).all()
    # Blocks 0..3 ran on the kept half of the 36 image tokens (+5 text tokens), block 4 on all of them; every call
    # used the backend chosen for the model.
    kept = TEXT + N // 2
    assert [s for s, _ in seen] == [kept] * 4 + [TEXT + N] and {b for _, b in seen} == {"AttentionBackendName._NATIVE_MATH"}


def test_lora_target_presets_and_lists_name_layers_inside_the_blocks():
    from backbones.adapters import lora_layers, lora_targets

    model = build("flux")  # 2 double-stream blocks, 3 single-stream blocks
    attention = lora_targets(model, "attention")
    assert attention == ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    mlp = lora_targets(model, "attention_mlp")
    assert "single_transformer_blocks.2.proj_mlp" in mlp and "single_transformer_blocks.2.proj_out" in mlp
    assert "transformer_blocks.1.ff_context.net.2" in mlp and "proj_out" not in mlp  # never the model's output layer
    everything = lora_targets(model, "all_linear")
    assert set(mlp) < set(everything) and "transformer_blocks.0.norm1.linear" in everything
    assert all(n.startswith(("transformer_blocks.", "single_transformer_blocks.")) for n in everything)
    assert lora_targets(model, ["proj_mlp", "to_q"]) == tuple(n for n in everything if n.endswith((".proj_mlp", ".to_q")))

    # Counted after injection: 8 attention projections in each double block (6 in the single ones, which have no
    # to_out and no text projections), and proj_mlp + proj_out + 4 feed-forward layers on top.
    add_lora(model, rank=2, targets="attention")
    assert lora_layers(model) == 2 * 8 + 3 * 3
    other = build("flux")
    add_lora(other, rank=2, targets=lora_targets(other, "attention_mlp"))
    assert lora_layers(other) == 2 * (8 + 4) + 3 * (3 + 2) == len(mlp)
    with pytest.raises(ConfigError, match=r"names \['proj_xyz'\], which match no linear layer in the blocks .* its layers are "):
        lora_targets(build("flux"), ["to_q", "proj_xyz"])
    with pytest.raises(ConfigError, match="finetune.lora.targets='mlp' is unknown; choose a preset"):
        lora_targets(build("flux"), "mlp")
