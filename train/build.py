"""Config -> objects: the trained network (a dataset-shaped backbone, or a pretrained diffusers transformer to
fine-tune) with its router, wrapped by the training objective (EDM or flow); and its EMA."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from timm.utils import ModelEmaV3
from torch import nn

from backbones import Backbone, build_backbone
from backbones.adapters import (PromptConditioned, adapt, add_lora, keep_labels, load_pretrained, lora_layers, lora_targets, model_config,
                                resolution_shift)
from edm import Objective, build_objective
from routing import ConfigError, Router, build_policy, resolve_routes
from train.compiling import compile_blocks, compile_mode, compile_network, compiled_graphs  # noqa: F401 (the trainer's imports)
from train.data.prompts import DTYPES, read_table


def build_router(cfg_routing: DictConfig, model: Backbone) -> Router:
    """Validated router for `model`; fails at start-up when the policy and the blocks do not fit."""
    return router_for(cfg_routing, model.depth, model.grid, model.block_cls.needs_grid, f"backbone '{model.family}'")


def router_for(cfg_routing: DictConfig, depth: int, grid: tuple[int, int], needs_grid: bool = False, what: str = "") -> Router:
    """Validated router for a stack of `depth` blocks on a `grid` of tokens (`what` names the model in errors)."""
    policy = build_policy(cfg_routing.policy, **(cfg_routing.get("policy_kwargs") or {}))
    specs = OmegaConf.to_container(cfg_routing.routes, resolve=True) or []
    routes = resolve_routes(specs, depth, fix=routes_fix(what, depth))
    for route in routes:
        policy.check(grid, route.selection_ratio)
    if routes and needs_grid and not policy.yields_grid and not cfg_routing.allow_unstructured:
        raise ConfigError(
            f"{what} scans tokens on a 2-D grid, but routing policy '{policy.name}' picks tokens "
            "without one; use routing=rows or routing=structured (or set routing.allow_unstructured=true to treat the subset as 1-D, an ablation)."
        )
    return Router(policy, routes, force=cfg_routing.force, fp32_after_route=cfg_routing.fp32_after_route)


def routes_fix(what: str, depth: int) -> str:
    """What to set when routing.routes does not fit a model of `depth` blocks: the routes come from the routing option
    or a +experiment preset (a finetune preset's fit the full pretrained model) unless given on the command line."""
    start, end = (1, -2) if depth >= 3 else (0, 0)
    example = f"routing.routes=[{{selection_ratio: 0.5, start_layer_idx: {start}, end_layer_idx: {end}}}]"
    return (f"routing.routes, for {what or 'the model'}, comes from the routing=... option or the +experiment=... "
            f"preset unless given on the command line; set routes that fit its {depth} blocks (e.g. '{example}') "
            "or use a model with more blocks")


def build_backbone_for(cfg: DictConfig, shape: tuple[int, int, int], num_classes: int) -> Backbone:
    b = cfg.backbone
    try:
        model = build_backbone(
            b.name,
            b.preset,
            input_size=tuple(shape[1:]),
            in_channels=shape[0],
            patch_size=b.patch_size,
            num_classes=num_classes,
            depth=b.get("depth"),
            hidden_size=b.get("hidden_size"),
            **(b.get("kwargs") or {}),
        )
    except ConfigError:
        raise
    except ValueError as err:  # a family's own check of its arguments (Mamba's headdim, RWKV's width)
        raise ConfigError(f"backbone={b.name} cannot be built with these settings: {str(err).rstrip('.')}; change backbone.kwargs "
                          "or backbone.hidden_size (python -m train --help).") from None
    model.attach_router(build_router(cfg.routing, model))
    model.router.checkpointing = bool(cfg.trainer.get("gradient_checkpointing") or False)
    return model


def objective_name(cfg: DictConfig) -> str:
    """The objective a config trains with; configs written before objectives existed trained EDM."""
    return (cfg.get("objective") or {}).get("name", "edm")


def objective_for(cfg: DictConfig) -> Objective:
    """The objective named by `objective.name`; EDM's settings stay under `edm:` where they have always been."""
    spec = {k: v for k, v in OmegaConf.to_container(cfg.get("objective") or OmegaConf.create({}), resolve=True).items() if k != "name"}
    name = objective_name(cfg)
    if name == "edm":
        spec = {"sigma_data": cfg.edm.sigma_data, "P_mean": cfg.edm.P_mean, "P_std": cfg.edm.P_std, **spec}
    try:
        return build_objective(name, **spec)
    except ValueError as err:  # edm knows nothing of ConfigError; its messages already name the key
        raise ConfigError(str(err)) from err


def finetune_family(cfg: DictConfig) -> str | None:
    """The pretrained family a config fine-tunes; None trains `backbone` from scratch (and configs saved before
    fine-tuning existed have no `finetune` section)."""
    return (cfg.get("finetune") or {}).get("family")


# Paths a run reads again later (resume, train.sample, train.fid), perhaps from another folder.
RUN_PATHS = ("finetune.pretrained", "finetune.prompts")
CAPTION_PATHS = ("data.path", "data.pipeline", "data.vae", "data.cache")


def absolute_paths(cfg: DictConfig) -> None:
    """Store RUN_PATHS (and a captioned folder's paths) as absolute paths, so the run folder's config works from any
    working directory."""
    paths = RUN_PATHS + (CAPTION_PATHS if cfg.data.name == "captions" else ())
    for path in paths:
        value = OmegaConf.select(cfg, path)
        if value is not None and value != "pixels":
            OmegaConf.update(cfg, path, str(Path(str(value)).expanduser().resolve()))
    prompts = OmegaConf.select(cfg, "sample.prompts")
    if isinstance(prompts, str):  # a file of validation prompts (a list of them stays as it is)
        OmegaConf.update(cfg, "sample.prompts", str(Path(prompts).expanduser().resolve()))


def check_base(model: nn.Module, trained_from: tuple[str, dict | None] | None, pretrained: str) -> None:
    """Refuse a base model in finetune.pretrained whose config differs from the one a checkpoint was fine-tuned from.

    `trained_from`: (the checkpoint folder, the base config its state.json records); None, or no recorded config
    (checkpoints written before it was recorded), checks nothing. Called as soon as the base is loaded, so that a changed
    base is named before the data-fit checks would blame the data, and again when the weights are loaded."""
    path, saved = trained_from or (None, None)
    if not saved:
        return
    mine = model_config(model)
    differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
    if differ:
        changes = "; ".join(f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in differ)  # trained -> now
        raise ConfigError(f"checkpoint '{path}' was fine-tuned from a {type(model).__name__} whose config differs in "
                          f"{changes} from the one in finetune.pretrained='{pretrained}'; point finetune.pretrained "
                          "at the model it was trained from.")


def build_finetuned(cfg: DictConfig, dataset, trained_from: tuple[str, dict | None] | None = None) -> nn.Module:
    """The pretrained model of `finetune`, ready to train on `dataset`: f(x, t, class_labels), as our backbones.

    Loaded from its local folder (base weights in finetune.dtype), LoRA added or every weight made trainable,
    adapted so its image tokens run through the router of cfg.routing, and for the text families conditioned
    through the prompt table's class prompts. `trained_from`: the checkpoint to be loaded into it and the base config
    it records (check_base), so that a changed base is refused as such before the data is checked against it.
    """
    f = cfg.finetune
    model = load_pretrained(f.family, f.pretrained, torch_dtype=DTYPES[f.dtype])
    check_base(model, trained_from, f.pretrained)
    if f.train == "lora":
        # Runs saved before finetune.lora.targets existed trained the attention projections.
        targets = f.lora.get("targets", "attention")
        targets = targets if isinstance(targets, str) else list(targets)
        add_lora(model, f.lora.rank, f.lora.alpha, f.lora.dropout, targets=lora_targets(model, targets))
    else:
        model.requires_grad_(True)
    if f.gradient_checkpointing or (cfg.trainer.get("gradient_checkpointing") or False):
        model.enable_gradient_checkpointing()
    net = adapt(model)
    name = f"the pretrained {net.model_class} in '{f.pretrained}'"
    # Bucketed data trains on several latent shapes; every one must fit the model and the routes.
    shapes = getattr(dataset, "bucket_shapes", [dataset.shape])
    for shape in shapes:
        net.router = router_for(cfg.routing, net.depth, token_grid(net, shape, cfg.data.name, name, len(shapes) > 1), what=name)
    if net.router.fuses:
        raise ConfigError(f"routing.routes has a SPRINT route (mode: sprint), whose fusion layer {name} does not have; "
                          "fine-tune with TREAD routes (routing=random or routing=structured).")
    if f.family == "dit":
        classes = model.config.num_embeds_ada_norm
        if dataset.num_classes != classes:
            raise ConfigError(f"data.name={cfg.data.name} has {dataset.num_classes} classes, but {name} embeds {classes} "
                              "(num_embeds_ada_norm); fine-tune it on data with its classes.")
        keep_labels(model)  # the trainer drops labels itself, once per sample and seeded
        return net.train()
    if f.family == "flux":
        # Runs saved before finetune.guidance existed gave the guidance embedding 1.0.
        net.guidance = float(f.get("guidance", 1.0))
        if net.guidance != 1.0 and not model.config.guidance_embeds:
            raise ConfigError(f"finetune.guidance={net.guidance:g} is Flux's distilled guidance, but {name} has no guidance embedding "
                              "(guidance_embeds=false, as FLUX.1-schnell); drop finetune.guidance.")
    if hasattr(dataset, "prompt_table"):
        # Captioned data: one row per distinct caption, encoded into the data's cache; kept in host memory, since a
        # large set's rows (captions x tokens x width) need not all sit on the accelerator.
        table = dataset.prompt_table()
        if table.family != f.family:
            raise ConfigError(f"the caption cache of data.path='{cfg.data.path}' was encoded for {table.family}, not {f.family}; "
                              "give data.cache another folder (or delete that one) to encode the captions again.")
        return PromptConditioned(net, table.tensors, on_device=False).train()
    table = read_table(f.prompts, f.family)
    if table.num_classes != dataset.num_classes:
        raise ConfigError(f"data.name={cfg.data.name} has {dataset.num_classes} classes, but finetune.prompts='{f.prompts}' holds "
                          f"{table.num_classes} class prompts; encode one prompt per class, in class order.")
    return PromptConditioned(net, table.tensors).train()


def token_grid(net, shape: tuple[int, ...], data: str, name: str, bucketed: bool = False) -> tuple[int, ...]:
    """The adapter's token grid for samples of `shape`, (C, H, W) or video (C, T, H, W); ConfigError, naming the data,
    when the channels or the sides do not fit the model."""
    channels, *sides = shape
    patch = tuple(net.patch) if isinstance(net.patch, (tuple, list)) else (net.patch,) * 2
    if channels != net.latent_channels or len(sides) != len(patch) or any(n % p for n, p in zip(sides, patch)):
        kind = "video latents (frames, height, width)" if len(patch) == 3 else "inputs"
        step = "x".join(map(str, patch)) if len(patch) == 3 else str(net.patch)
        raise ConfigError(f"data.name={data} gives {'x'.join(map(str, shape))} inputs, but {name} takes "
                          f"{net.latent_channels}-channel {kind} with sides divisible by {step}; fine-tune it on latents of its own VAE"
                          f"{' (data.alignment: a multiple of the VAE factor x ' + str(net.patch) + ')' if bucketed else ''}.")
    return tuple(n // p for n, p in zip(sides, patch))


def build_net(cfg: DictConfig, dataset, trained_from: tuple[str, dict | None] | None = None) -> nn.Module:
    """The trained network for `dataset`: D(x; sigma, labels) for EDM, v(z, t, labels) for flow. `trained_from`: when
    fine-tuning, the checkpoint to be loaded and its recorded base config (build_finetuned)."""
    if finetune_family(cfg):
        return objective_for(cfg).wrap(build_finetuned(cfg, dataset, trained_from))
    return objective_for(cfg).wrap(build_backbone_for(cfg, dataset.shape, dataset.num_classes))


def describe_finetuning(cfg: DictConfig, net: nn.Module) -> str:
    """One line for the run's start: the base model, its size, and what trains (LoRA: how many layers and tensors)."""
    f, model = cfg.finetune, pretrained_of(net)
    params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    line = f"{f.family} from {f.pretrained} ({params / 1e6:.2f}M params, {trained / 1e6:.2f}M trained, finetune.train={f.train})"
    if f.train == "lora":
        layers = lora_layers(model)
        targets = f.lora.get("targets", "attention")
        targets = targets if isinstance(targets, str) else "[" + ",".join(targets) + "]"
        line += f"; LoRA r{f.lora.rank} on {layers} layers (finetune.lora.targets={targets}): {2 * layers} trained tensors"
    return line


def time_shift(cfg: DictConfig, which: str, patch: int) -> Callable[[tuple[int, ...]], float] | None:
    """The time shift of a fine-tuning run's training draws (`which="train"`) or sampling grid ("sample") as a function
    of the sample shape (C, H, W); None where the run keeps the objective's own (unshifted draws, objective.shift grid).

    fixed: objective.shift (SD3's 3). resolution: Flux's exp(mu), mu from the image tokens (H/patch x W/patch) with the
    pipeline's scheduler constants. Configs saved before these keys existed shifted neither.
    """
    f = cfg.get("finetune") or {}
    mode = f.get(f"{which}_shift") or ("none" if which == "train" else "fixed")
    if not f.get("family") or mode == "none" or (which == "sample" and mode == "fixed"):
        return None
    if mode == "fixed":
        fixed = float(cfg.objective.shift)
        return lambda shape: fixed
    shift = resolution_shift(f.pretrained)
    return lambda shape: shift((shape[-2] // patch) * (shape[-1] // patch))


def sampling_objective(cfg: DictConfig, objective: Objective, net: nn.Module, shape: tuple[int, ...]) -> Objective:
    """The objective to sample `shape` with: the run's, its grid shifted as finetune.sample_shift says."""
    shift = time_shift(cfg, "sample", net.patch) if finetune_family(cfg) else None
    return objective if shift is None else dataclasses.replace(objective, shift=shift(shape))


def routed_blocks(net: nn.Module) -> list[nn.Module]:
    """The blocks the router runs (our backbones' `blocks`, an adapter's diffusers blocks): FSDP's units."""
    inner = getattr(net.model, "adapter", net.model)
    return [step.block for step in inner.steps] if hasattr(inner, "steps") else list(inner.blocks)


def pretrained_of(net: nn.Module) -> nn.Module:
    """The diffusers model inside a fine-tuning network (objective wrapper -> [PromptConditioned ->] adapter)."""
    return net.model.pretrained


class TrainableEma(nn.Module):
    """EMA of the trainable parameters only, for fine-tuning; `module` is sampled like ModelEmaV3's.

    timm's ModelEmaV3 deep-copies the whole network and averages every tensor: with a frozen 12B base that
    doubles the weights' memory to average tensors that never change. Here the copy shares every frozen
    parameter and buffer with the trained network (a deepcopy memo that maps each to itself), and only the
    trainable tensors are copied and averaged, with ModelEmaV3's decay and warm-up.
    """

    def __init__(self, model: nn.Module, decay: float, use_warmup: bool, device=None):
        super().__init__()
        shared = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
        self.module = copy.deepcopy(model, memo={id(t): t for t in shared}).eval()
        if device is not None:
            self.module.to(device)
        self.decay, self.use_warmup = decay, use_warmup
        self.averaged = [p for p in self.module.parameters() if p.requires_grad]

    def get_decay(self, step: int) -> float:
        """ModelEmaV3.get_decay (update_after_step 0): 0 at the first update, then 1 - (1 + s)^(-2/3) up to `decay`."""
        step = max(0, step - 1)
        if step <= 0:
            return 0.0
        return min(1 - (1 + step) ** (-2 / 3), self.decay) if self.use_warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        trained = [p for p in model.parameters() if p.requires_grad]
        torch._foreach_lerp_(self.averaged, trained, 1.0 - self.get_decay(step))


def build_ema(cfg: DictConfig, net: nn.Module, device) -> nn.Module:
    """The EMA of the sampled weights: of the whole network from scratch, of the trained tensors when fine-tuning."""
    t = cfg.trainer
    # Both update with foreach kernels: one launch per list of tensors, not per tensor.
    ema = TrainableEma if finetune_family(cfg) else ModelEmaV3
    return ema(net, decay=t.ema_decay, use_warmup=t.ema_warmup, device=device)
