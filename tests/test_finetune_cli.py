"""`python -m train` fine-tunes pretrained diffusers transformers: tiny random models written to local folders,
LoRA through peft, TREAD routing, adapter-only checkpoints, exact resume, sampling, and one-sentence refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backbones.adapters import FAMILIES, PromptConditioned, adapt, add_lora, keep_labels, load_lora, load_pretrained, lora_state_dict, lora_targets
from routing import ConfigError
from train.build import TrainableEma, pretrained_of
from train.checkpoint import load_run
from train.data.prompts import random_table, write_table
from train.schema import check_config
from train.trainer import Trainer
from conftest import FAST, compose_cfg, run_cli

# Tiny models for data=digits (1 channel, 16x16, 10 classes): 8x8 image tokens, 4 routed blocks, 2 heads.
TINY = {
    "flux": dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=24, pooled_projection_dim=12, axes_dims_rope=(4, 6, 6)),
    "sd3": dict(sample_size=16, patch_size=2, in_channels=1, out_channels=1, num_layers=4, attention_head_dim=8, num_attention_heads=2,
                joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=12, pos_embed_max_size=16),
    "pixart": dict(num_attention_heads=2, attention_head_dim=8, in_channels=1, out_channels=2, num_layers=4, cross_attention_dim=16,
                   sample_size=16, patch_size=2, caption_channels=24),
    "dit": dict(num_attention_heads=2, attention_head_dim=8, in_channels=1, out_channels=2, num_layers=4, sample_size=16, patch_size=2,
                num_embeds_ada_norm=10),
}
TABLE_SIZES = {"flux": (4, 24, 12), "sd3": (4, 24, 12), "pixart": (4, 24)}  # text tokens, width[, pooled width]
ROUTES = "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 1, end_layer_idx: -2}]"


def write_pretrained(family: str, folder: Path, **changes) -> Path:
    import diffusers

    torch.manual_seed(0)
    getattr(diffusers, FAMILIES[family].model_class)(**{**TINY[family], **changes}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """family -> pretrained folder, and "family_prompts" -> its random prompt table for the 10 digit classes."""
    root = tmp_path_factory.mktemp("pretrained")
    paths = {}
    for family in TINY:
        paths[family] = write_pretrained(family, root / family)
        if family in TABLE_SIZES:
            table = random_table(family, [f"a handwritten {d}" for d in range(10)], TABLE_SIZES[family])
            paths[f"{family}_prompts"] = write_table(table, root / f"{family}.safetensors")
    return paths


def finetune(models, family: str, *extra: str) -> list[str]:
    """Overrides that fine-tune the tiny `family` model with LoRA rank 4 and a route over blocks 1..2."""
    args = ["objective=flow", "routing=random", ROUTES, f"finetune.family={family}", f"finetune.pretrained={models[family]}",
            "finetune.lora.rank=4"]
    if family in TABLE_SIZES:
        args.append(f"finetune.prompts={models[family + '_prompts']}")
    return [*args, *extra]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_inputs(family: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, t = torch.randn(2, 1, 16, 16, generator=g), torch.rand(2, generator=g)
    return x, t, {"encoder_hidden_states": torch.randn(2, 4, 24, generator=g), "pooled_projections": torch.randn(2, 12, generator=g)}


def pipeline_with(family: str, transformer):
    """The family's diffusers pipeline around `transformer`, without text encoders or VAE (none is needed to load a LoRA)."""
    import diffusers

    parts = dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                 text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    if family == "sd3":
        return diffusers.StableDiffusion3Pipeline(**parts, text_encoder_3=None, tokenizer_3=None)
    return diffusers.FluxPipeline(**parts)


def test_cli_fine_tunes_flux_keeping_only_the_adapter_then_samples(models, tmp_path):
    run = tmp_path / "run"
    preset = ["+experiment=finetune_flux", f"finetune.pretrained={models['flux']}", f"finetune.prompts={models['flux_prompts']}",
              "finetune.dtype=fp32", "finetune.gradient_checkpointing=false", "trainer.mixed_precision=no", "trainer.lr=1e-2",
              "finetune.lora.rank=4", "finetune.lora.alpha=8", "finetune.lora.targets=attention_mlp", "data=digits"]
    fast = [a for a in FAST if not a.startswith(("trainer.max_steps=", "trainer.ckpt_every="))]  # each key once on a command line
    result = run_cli("train", *preset, *fast, "trainer.max_steps=3", "trainer.ckpt_every=3", f"run_dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"flux from {models['flux']}" in result.stdout

    # model.safetensors and ema.safetensors hold the LoRA tensors only, with peft's keys: attention and MLP layers.
    ckpt = run / "checkpoints" / "step_0000003"
    base = load_pretrained("flux", models["flux"])
    full_bytes = (models["flux"] / "diffusion_pytorch_model.safetensors").stat().st_size
    layers = lora_targets(base, "attention_mlp")
    add_lora(base, rank=4, targets=layers)
    assert f"LoRA r4 on {len(layers)} layers (finetune.lora.targets=attention_mlp): {2 * len(layers)} trained tensors" in result.stdout
    expected = set(lora_state_dict(base))
    weights, ema = load_file(ckpt / "model.safetensors"), load_file(ckpt / "ema.safetensors")
    assert set(weights) == set(ema) == expected and all(".lora_" in k for k in expected)
    assert (ckpt / "model.safetensors").stat().st_size < full_bytes / 4

    # lora/ is the EMA adapter in diffusers' pipeline format: transformer.-prefixed keys, and FluxPipeline loads it
    # with no other argument into the network train.sample samples (alpha 8 / rank 4 read from the metadata).
    exported = load_file(ckpt / "lora" / "pytorch_lora_weights.safetensors")
    assert set(exported) == {f"transformer.{k}" for k in ema} and all(torch.equal(exported[f"transformer.{k}"], ema[k]) for k in ema)
    fine_tuned = adapt(pretrained_of(load_run(run).net)).eval()
    pipe = pipeline_with("flux", load_pretrained("flux", models["flux"]))
    pipe.load_lora_weights(ckpt / "lora")
    x, t, cond = same_inputs("flux")
    with torch.no_grad():
        ours, theirs, untuned = fine_tuned.reference(x, t, cond), adapt(pipe.transformer).reference(x, t, cond), adapt(base).reference(x, t, cond)
    assert (ours - theirs).abs().max() <= 1e-6 < (ours - untuned).abs().max()
    ours_too = load_pretrained("flux", models["flux"])
    load_lora(ours_too, ckpt / "lora")
    with torch.no_grad():
        assert torch.equal(adapt(ours_too).reference(x, t, cond), ours)

    # lora_raw/ is the raw adapter (model.safetensors) in the same format, which the pipeline loads likewise.
    raw = load_file(ckpt / "lora_raw" / "pytorch_lora_weights.safetensors")
    assert set(raw) == {f"transformer.{k}" for k in weights} and all(torch.equal(raw[f"transformer.{k}"], weights[k]) for k in weights)
    pipe = pipeline_with("flux", load_pretrained("flux", models["flux"]))
    pipe.load_lora_weights(ckpt / "lora_raw")
    raw_model = load_pretrained("flux", models["flux"])
    load_lora(raw_model, ckpt / "lora_raw")
    with torch.no_grad():
        raw_out = adapt(raw_model).reference(x, t, cond)
        assert (adapt(pipe.transformer).reference(x, t, cond) - raw_out).abs().max() <= 1e-6 < (raw_out - ours).abs().max()

    out = tmp_path / "grid.png"
    sampled = run_cli("train.sample", str(run), "--steps", "2", "--per-class", "1", "--guidance", "2", "--out", str(out))
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    from PIL import Image

    assert Image.open(out).size[1] > 10 * 16  # one row per class


def test_sd3_preset_exports_a_lora_its_pipeline_loads(models, tmp_path):
    cfg = compose_cfg("+experiment=finetune_sd3", f"finetune.pretrained={models['sd3']}", f"finetune.prompts={models['sd3_prompts']}",
                      "finetune.dtype=fp32", "finetune.gradient_checkpointing=false", "trainer.mixed_precision=no", "trainer.lr=1e-2",
                      "finetune.lora.rank=4", "finetune.lora.alpha=2", "data=digits", *FAST, "trainer.ckpt_every=2", f"run_dir={tmp_path / 'run'}")
    Trainer(cfg).fit()
    folder = tmp_path / "run" / "checkpoints" / "step_0000002" / "lora"
    pipe = pipeline_with("sd3", load_pretrained("sd3", models["sd3"]))
    pipe.load_lora_weights(folder)
    x, t, cond = same_inputs("sd3")
    with torch.no_grad():
        ours = adapt(pretrained_of(load_run(tmp_path / "run").net)).reference(x, t, cond)
        theirs = adapt(pipe.transformer).reference(x, t, cond)
        untuned = adapt(load_pretrained("sd3", models["sd3"])).reference(x, t, cond)
    assert (ours - theirs).abs().max() <= 1e-6 < (ours - untuned).abs().max()


@pytest.mark.parametrize("family, extra", [
    ("sd3", ["edm.loss=route_aware"]),
    ("pixart", ["finetune.gradient_checkpointing=true"]),
    ("dit", ["finetune.train=full"]),
])
def test_trainer_fine_tunes_each_family_through_its_routes(models, family, extra, tmp_path):
    cfg = compose_cfg(*FAST, *finetune(models, family, *extra), "trainer.ckpt_every=2", f"run_dir={tmp_path / 'run'}")
    trainer = Trainer(cfg)
    model = trainer.backbone.pretrained
    full = cfg.finetune.train == "full"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(p.requires_grad == (full or ".lora_" in n) for n, p in model.named_parameters())
    trained = [p for p in trainer.net.parameters() if p.requires_grad]
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {id(p) for p in trained}

    assert all(torch.isfinite(torch.tensor(trainer.fit())))
    # Routing was active in training: one route that processed some, not all, of the 64 image tokens.
    (mask,) = trainer.backbone.router.last_masks
    assert mask.shape[1] == 64 and (0 < mask.sum(1)).all() and (mask.sum(1) < 64).all()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    if full:
        assert changed
    else:
        assert changed and all(".lora_" in n for n in changed)  # the base weights are untouched

    # The EMA copies the trained tensors only; frozen ones are the network's own tensors.
    ema_model = trainer.ema.module.model.pretrained
    for (name, p), q in zip(model.named_parameters(), ema_model.parameters()):
        assert (p is q) != p.requires_grad, name
    saved = load_file(tmp_path / "run" / "checkpoints" / "step_0000002" / "model.safetensors")
    assert set(saved) == (set(model.state_dict()) if full else set(lora_state_dict(model)))
    assert (tmp_path / "run" / "checkpoints" / "step_0000002" / "lora").is_dir() != full


def test_resume_continues_a_fine_tuning_run_exactly(models, tmp_path):
    # LoRA dropout draws from the global RNG, which the checkpoint restores.
    common = [*FAST, *finetune(models, "flux", "finetune.lora.dropout=0.1"), "trainer.batch_size=4"]
    Trainer(compose_cfg(*common, "trainer.max_steps=4", "trainer.ckpt_every=4", f"run_dir={tmp_path / 'straight'}")).fit()
    Trainer(compose_cfg(*common, "trainer.max_steps=2", "trainer.ckpt_every=2", f"run_dir={tmp_path / 'split'}")).fit()
    Trainer(compose_cfg(*common, "trainer.max_steps=4", "trainer.ckpt_every=4", f"run_dir={tmp_path / 'split'}", "resume=true")).fit()
    assert losses(tmp_path / "split") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_file(tmp_path / run / "checkpoints" / "step_0000004" / name) for run in ("straight", "split"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    # Another LoRA rank, or a base model whose config changed since, is refused; by load_run (train.sample) too.
    with pytest.raises(ConfigError, match="does not fit this model"):
        Trainer(compose_cfg(*common, "finetune.lora.rank=8", "trainer.max_steps=6", f"run_dir={tmp_path / 'split'}", "resume=true"))
    other = write_pretrained("flux", tmp_path / "other", num_single_layers=3)
    with pytest.raises(ConfigError, match=r"fine-tuned from a FluxTransformer2DModel whose config differs in num_single_layers: \d+ -> 3 from"):
        Trainer(compose_cfg(*common, f"finetune.pretrained={other}", "trainer.max_steps=6", f"run_dir={tmp_path / 'split'}", "resume=true"))
    moved = tmp_path / "moved"
    shutil.copytree(models["flux"], moved)
    run = tmp_path / "run"
    Trainer(compose_cfg(*common, f"finetune.pretrained={moved}", "trainer.max_steps=1", "trainer.ckpt_every=1", f"run_dir={run}")).fit()
    assert load_run(run).step == 1
    # The base moved: named, with the flag that finds it; found there, with its config checked as before.
    elsewhere = tmp_path / "elsewhere"
    moved.rename(elsewhere)
    with pytest.raises(ConfigError, match="which is not there any more; pass --pretrained PATH"):
        load_run(run)
    assert load_run(run, pretrained=str(elsewhere)).step == 1
    elsewhere.rename(moved)
    write_pretrained("flux", moved, num_single_layers=3)
    with pytest.raises(ConfigError, match="point finetune.pretrained at the model it was trained from"):
        load_run(run)


@pytest.mark.parametrize("family, change, differs", [("flux", {"in_channels": 64}, "in_channels: 4 -> 64"),
                                                     ("dit", {"num_embeds_ada_norm": 7}, "num_embeds_ada_norm: 10 -> 7")])
def test_a_base_changed_since_the_checkpoint_is_named_not_the_data(models, tmp_path, family, change, differs):
    """A base rewritten with other input channels (Flux) or classes (DiT) no longer fits the data either: resume and
    load_run (train.sample) name the changed base, as the checkpoint records it, not the data."""
    base, run = tmp_path / "base", tmp_path / "run"
    shutil.copytree(models[family], base)
    common = [*FAST, *finetune(models, family, f"finetune.pretrained={base}"), f"run_dir={run}", "trainer.ckpt_every=1"]
    Trainer(compose_cfg(*common, "trainer.max_steps=1")).fit()
    write_pretrained(family, base, **change)
    want = rf"fine-tuned from a \w+ whose config differs in {differs} from the one in finetune.pretrained="
    with pytest.raises(ConfigError, match=want):
        Trainer(compose_cfg(*common, "trainer.max_steps=2", "resume=true"))
    with pytest.raises(ConfigError, match=want):
        load_run(run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_0000001"]  # nothing lost


def test_a_preset_route_that_a_small_pretrained_model_cannot_hold_says_where_it_came_from(models, tmp_path):
    """+experiment=finetune_dit's route (blocks 2..-4) on a 4-block DiT: the refusal names the model's blocks, that the
    route came from the preset or the routing option, and what to set."""
    cfg = compose_cfg(*FAST, "+experiment=finetune_dit", "data=digits", f"finetune.pretrained={models['dit']}",
                      "finetune.dtype=fp32", "trainer.mixed_precision=no", f"run_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert ("resolves to start 2 > end 0 on the model's 4 blocks; routing.routes, for the pretrained "
            f"DiTTransformer2DModel in '{models['dit']}', comes from the routing=... option or the +experiment=... "
            "preset unless given on the command line; set routes that fit its 4 blocks (e.g. 'routing.routes="
            "[{selection_ratio: 0.5, start_layer_idx: 1, end_layer_idx: -2}]') or use a model with more blocks."
            ) in str(err.value)
    assert not (tmp_path / "run").exists()


def test_bf16_base_weights_train_fp32_lora_and_sample(models, tmp_path):
    """The fp32 LoRA trains on a bf16 base under autocast; the preview grid, train.sample and a bare call, which pass
    fp32 latents outside any autocast, run the base in bf16 as training did (they failed on its bf16 layers)."""
    run = tmp_path / "run"
    cfg = compose_cfg(*FAST, *finetune(models, "flux", "finetune.dtype=bf16", "trainer.mixed_precision=bf16"),
                      "trainer.max_steps=1", "trainer.sample_every=1", "trainer.ckpt_every=1", "sample.steps=2", f"run_dir={run}")
    trainer = Trainer(cfg)
    assert all(torch.isfinite(torch.tensor(trainer.fit())))
    dtypes = {(".lora_" in n, p.dtype) for n, p in trainer.backbone.pretrained.named_parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    assert (run / "samples" / "step_0000001.png").is_file()
    sampled = run_cli("train.sample", str(run), "--steps", "2", "--per-class", "1", "--out", str(tmp_path / "grid.png"))
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    adapter = adapt(load_pretrained("flux", models["flux"], torch.bfloat16)).eval()
    x, t, cond = same_inputs("flux")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = adapter(x, t, cond)
    with torch.no_grad():
        assert torch.equal(adapter(x, t, cond), want)
        torch.testing.assert_close(adapter.reference(x, t, cond), want)  # the oracle too, in the base's precision


def test_prompt_conditioned_maps_labels_to_their_table_rows(models):
    from train.data.prompts import read_table

    table = read_table(models["flux_prompts"], "flux")
    adapter = adapt(load_pretrained("flux", models["flux"])).eval()
    net = PromptConditioned(adapter, table.tensors)
    g = torch.Generator().manual_seed(0)
    x, t, labels = torch.randn(3, 1, 16, 16, generator=g), torch.rand(3, generator=g), torch.tensor([0, 7, 10])
    rows = {k: v[labels] for k, v in table.tensors.items()}
    assert torch.equal(net(x, t, labels), adapter(x, t, rows))
    assert torch.equal(net(x, t, None), adapter(x, t, {k: v[[10, 10, 10]] for k, v in table.tensors.items()}))  # the empty prompt


def test_dit_drops_labels_only_where_the_trainer_does(models):
    adapter = adapt(load_pretrained("dit", models["dit"])).train()
    x, t, labels = torch.randn(64, 1, 16, 16), torch.rand(64), torch.arange(64) % 10
    keep_labels(adapter.model)
    torch.manual_seed(0)
    first = adapter(x, t, labels)
    torch.manual_seed(1)  # diffusers' own dropout would draw other drops from another global RNG state
    assert torch.equal(adapter(x, t, labels), first)
    assert torch.equal(adapter.eval()(x, t, labels), first)


def test_trainable_ema_averages_like_timm_without_copying_frozen_weights():
    from timm.utils import ModelEmaV3

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    net[0].requires_grad_(False)
    ours, timm = TrainableEma(net, decay=0.9, use_warmup=True), ModelEmaV3(net, decay=0.9, use_warmup=True)
    for step in range(1, 6):
        with torch.no_grad():
            net[1].weight.add_(1.0)
        ours.update(net, step=step)
        timm.update(net, step=step)
    assert torch.equal(ours.module[1].weight, timm.module[1].weight) and not torch.equal(ours.module[1].weight, net[1].weight)
    assert ours.module[0].weight is net[0].weight and timm.module[0].weight is not net[0].weight


@pytest.mark.parametrize("family", sorted(TINY))
def test_presets_compose_into_a_checked_fine_tuning_config(models, family):
    overrides = [f"+experiment=finetune_{family}", f"finetune.pretrained={models[family]}"]
    if family in TABLE_SIZES:
        overrides.append(f"finetune.prompts={models[family + '_prompts']}")
    cfg = compose_cfg("run_dir=/tmp/unused", *overrides)
    check_config(cfg)
    assert cfg.finetune.family == family and cfg.objective.name == "flow" and cfg.routing.policy == "random"
    assert cfg.routing.routes[0].selection_ratio == 0.5 and cfg.routing.routes[0].start_layer_idx == 2


@pytest.mark.parametrize("overrides, message", [
    (["finetune.family=flux"], "finetune.family=flux needs finetune.pretrained=<local folder"),
    (["finetune.pretrained={flux}"], "finetune.pretrained is set but finetune.family is null"),
    (["finetune.family=flux", "finetune.pretrained={flux}", "finetune.prompts={flux_prompts}"],
     "fine-tuning trains with rectified flow, but objective=edm; add objective=flow."),
    (["objective=flow", "finetune.family=sd3", "finetune.pretrained={sd3}"], "finetune.family=sd3 conditions on text; give finetune.prompts="),
    (["objective=flow", "finetune.family=dit", "finetune.pretrained={dit}", "finetune.prompts={sd3_prompts}"],
     "finetune.family=dit takes class labels itself; drop finetune.prompts."),
    (["objective=flow", "finetune.family=flux", "finetune.pretrained={dit}", "finetune.prompts={flux_prompts}"],
     "holds a DiTTransformer2DModel, not the FluxTransformer2DModel that family 'flux' needs"),
    (["objective=flow", "finetune.family=dit", "finetune.pretrained={dit}", "finetune.train=full", "finetune.dtype=bf16"],
     "finetune.train=full trains every weight, which stays fp32; set finetune.dtype=fp32"),
    (["objective=flow", "finetune.family=dit", "finetune.pretrained={dit}", "finetune.dtype=bf16"], "add trainer.mixed_precision=bf16."),
    (["objective=flow", "finetune.family=dit", "finetune.pretrained={dit}", "finetune.dtype=bf16", "trainer.mixed_precision=bf16",
      "routing.fp32_after_route=true"], "which bf16 base weights (finetune.dtype=bf16) cannot"),
    (["objective=flow", "finetune.family=dit", "finetune.pretrained={dit}", "trainer.compile=true"], "drop trainer.compile."),
    (["objective=flow", "finetune.family=dit", "finetune.pretrained={dit}", "finetune.lora.targets=mlp"],
     "finetune.lora.targets='mlp' is neither a preset (attention, attention_mlp, all_linear) nor a list of layer names"),
])
def test_config_refusals_name_the_key_and_the_fix(models, overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg("run_dir=/tmp/unused", *(o.format(**models) for o in overrides)))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_build_refuses_data_the_model_or_table_does_not_fit(models, tmp_path):
    few = write_table(random_table("flux", ["a", "b", "c"], TABLE_SIZES["flux"]), tmp_path / "three.safetensors")
    narrow = write_table(random_table("flux", [str(d) for d in range(10)], (4, 16, 12)), tmp_path / "narrow.safetensors")
    cases = [
        (finetune(models, "flux", f"finetune.prompts={few}"), "data.name=digits has 10 classes, but finetune.prompts="),
        (finetune(models, "flux", f"finetune.prompts={models['sd3_prompts']}"), "was encoded for sd3, not flux"),
        (finetune(models, "flux", f"finetune.prompts={narrow}"),
         "prompt table's encoder_hidden_states is 16 wide, but this FluxTransformer2DModel's joint_attention_dim is 24"),
        (finetune(models, "dit", "data=shapes"), "gives 3x32x32 inputs, but the pretrained DiTTransformer2DModel in"),
    ]
    other = write_pretrained("dit", tmp_path / "dit1000", num_embeds_ada_norm=1000)
    cases.append((finetune(models, "dit", f"finetune.pretrained={other}"), "has 10 classes, but the pretrained DiTTransformer2DModel"))
    for i, (overrides, message) in enumerate(cases):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Trainer(compose_cfg(*FAST, *overrides, f"run_dir={tmp_path / str(i)}"))


def test_cli_names_what_to_fetch_for_a_missing_pretrained_folder(tmp_path, capsys):
    from train.cli import precompose  # what `python -m train` runs before Hydra makes the run folder

    with pytest.raises(SystemExit) as exit_:
        precompose("config", ["objective=flow", "finetune.family=flux", f"finetune.pretrained={tmp_path / 'FLUX.1-dev'}",
                              f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "huggingface-cli download black-forest-labs/FLUX.1-dev --include 'transformer/*'" in err
    assert not (tmp_path / "run").exists()


def test_the_documented_cpu_demo_runs(tmp_path):
    """docs/finetuning.md's tiny-Flux Fashion-MNIST commands, for 2 steps on a few fake Fashion-MNIST images."""
    import runpy

    from test_fashion_mnist import fake_fashion

    script = runpy.run_path(str(Path(__file__).parents[1] / "docs" / "figures" / "finetune_tiny_flux.py"))
    script["main"](["--write-pretrained", str(tmp_path / "pretrained"), "--latent-channels", "1"])
    prompts = write_table(random_table("flux", [f"class {k}" for k in range(10)], (8, 64, 32)), tmp_path / "prompts.safetensors")
    demo = ["+experiment=finetune_flux", "data=fashion_mnist", f"data.path={fake_fashion(tmp_path / 'fm')}",
            f"finetune.pretrained={tmp_path / 'pretrained'}", f"finetune.prompts={prompts}", "finetune.dtype=fp32",
            "finetune.gradient_checkpointing=false", "trainer.mixed_precision=no", "trainer.cpu=true", "trainer.lr=1e-3"]
    trainer = Trainer(compose_cfg(*demo, "trainer.max_steps=2", "trainer.batch_size=4", "trainer.sample_every=0",
                                  "trainer.ckpt_every=0", f"run_dir={tmp_path / 'run'}"))
    assert trainer.backbone.depth == 6 and [(r.start_layer_idx, r.end_layer_idx) for r in trainer.backbone.router.routes] == [(2, 4)]
    assert all(torch.isfinite(torch.tensor(trainer.fit())))


def test_another_objective_under_a_preset_is_refused_naming_the_cause(models, tmp_path, capsys):
    from train.cli import precompose

    with pytest.raises(SystemExit) as exit_:
        precompose("config", ["+experiment=finetune_flux", f"finetune.pretrained={models['flux']}", "objective=edm",
                              f"finetune.prompts={models['flux_prompts']}", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err == "error: fine-tuning trains with rectified flow, but objective=edm; add objective=flow."


def test_a_relative_pretrained_path_is_stored_absolute(models, tmp_path, monkeypatch):
    shutil.copytree(models["flux"], tmp_path / "weights" / "flux")
    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg(*FAST, *finetune(models, "flux"), "finetune.pretrained=weights/flux", "trainer.max_steps=1",
                      "trainer.ckpt_every=1", f"run_dir={tmp_path / 'run'}")
    Trainer(cfg).fit()
    monkeypatch.chdir(tmp_path / "run")  # train.sample and train.fid from another folder
    assert load_run(tmp_path / "run").cfg.finetune.pretrained == str(tmp_path / "weights" / "flux")
