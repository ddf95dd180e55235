"""`check_config`: every cheap check of a composed config, before any work starts; one sentence per mistake.

Types and unknown keys are checked by merging the values over the schema's dataclasses (Hydra already does
this when it composes; a config built by hand gets the same check here). Then every key with a range or a
list of choices is checked, `data` and `objective` against the schema of their option, and
`backbone.kwargs` against the family's Block signature.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import typing
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from routing.errors import ConfigError
from train.schema.align import check_align
from train.schema.backbone import KWARG_CHOICES, KWARG_RANGES, resolved_backbone
from train.schema.config import Config
from train.schema.data import DATA
from train.schema.finetune import FAMILIES, TEXT_FAMILIES
from train.schema.keys import APPLY, REFUSE, describe_range, in_range
from train.schema.objective import OBJECTIVES
from train.schema.trainer import TRACKERS, tracker_list

# Keys whose value is the run itself, not a setting: never compared on resume.
RUN_KEYS = ("run_dir", "resume", "overwrite")
# Sections whose option picks their schema.
OPTION_SCHEMAS = {"data": DATA, "objective": OBJECTIVES}


# Walking the schema.


def _base_type(tp: Any) -> Any:
    """int for int / Optional[int]; list for List[float]; the dataclass for a group."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else Any
    return origin or tp


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        f.type = hints[f.name]
        out[f.name] = f
    return out


def schema_for(path: str, cfg: Any = None) -> tuple[Any, dict] | None:
    """(type, metadata) of dotted key `path` (e.g. 'trainer.lr', 'data.num_images'); None if not in the schema.

    For `data.*` and `objective.*` the option comes from `cfg` (its name), or from a `name[option]` prefix.
    """
    parts = path.split(".")
    cls: Any = Config
    for i, part in enumerate(parts):
        if cls in (Config,) and part in OPTION_SCHEMAS:
            name = _option(cfg, part)
            if name not in OPTION_SCHEMAS[part]:
                return None
            cls = OPTION_SCHEMAS[part][name]
            continue
        fields = _fields(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return None
        tp = _base_type(fields[part].type)
        if i == len(parts) - 1:
            return fields[part].type, dict(fields[part].metadata)
        if not dataclasses.is_dataclass(tp):
            return None
        cls = tp
    return None


def _option(cfg: Any, section: str) -> str | None:
    try:
        node = cfg[section] if cfg is not None else None
        return str(node["name"]) if node is not None and "name" in node else None
    except Exception:
        return None


def _leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, dict]]:
    for name, f in _fields(cls).items():
        tp = _base_type(f.type)
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", f.type, dict(f.metadata)


def numeric_keys() -> list[tuple[tuple[str, ...], str, type, dict]]:
    """Every int/float key of the schema: (group overrides that select it, dotted key, int|float, metadata)."""
    out = []
    for path, tp, meta in _leaves(Config):
        base = _base_type(tp)
        if base is list:
            base = float if typing.get_args(tp) and typing.get_args(tp)[0] is float else base
        if base in (int, float):
            out.append(((), path, base, meta))
    for section, options in OPTION_SCHEMAS.items():
        for option, cls in options.items():
            for path, tp, meta in _leaves(cls, f"{section}."):
                if _base_type(tp) in (int, float):
                    out.append(((f"{section}={option}",), path, _base_type(tp), meta))
    return out


# Messages.


def _type_name(tp: Any) -> str:
    base = _base_type(tp)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "a mapping"}
    text = names.get(base, "a value of the documented type")
    return text + (" or null" if typing.get_origin(tp) is typing.Union else "")


def _example(path: str, meta: dict) -> str:
    example = meta.get("example")
    return f" (e.g. {path}={str(example).lower() if isinstance(example, bool) else example})" if example is not None else ""


def wrong_type(path: str, value: Any, cfg: Any = None) -> ConfigError:
    found = schema_for(path, cfg)
    if found is None:
        return ConfigError(f"{path}={value!r} has the wrong type; see `python -m train --help` for the expected one.")
    tp, meta = found
    if _base_type(tp) is bool:
        return ConfigError(f"{path}={value!r} is not true or false; write {path}=true or {path}=false.")
    rng = describe_range(meta)
    return ConfigError(f"{path}={value!r} is not {_type_name(tp)}; it must be {_type_name(tp)}{' ' + rng if rng else ''}{_example(path, meta)}.")


def out_of_range(path: str, value: Any, meta: dict) -> ConfigError:
    if meta.get("choices"):
        return ConfigError(f"{path}={value!r} is unknown; choose {describe_range(meta)}{_example(path, meta)}.")
    items = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        shown, bounds = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value, describe_range(meta)
        return ConfigError(f"{path}={shown!r} is not a finite number; give a finite value{' ' + bounds if bounds else ''}"
                           f"{_example(path, meta)}.")
    return ConfigError(f"{path}={value!r} is out of range; it must be {describe_range(meta)}{_example(path, meta)}.")


def _known_keys(path: str, cfg: Any) -> list[str]:
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    if not parent:
        return [f.name for f in dataclasses.fields(Config)]
    found = schema_for(parent, cfg)
    if parent in OPTION_SCHEMAS and _option(cfg, parent) in OPTION_SCHEMAS[parent]:
        return [f.name for f in dataclasses.fields(OPTION_SCHEMAS[parent][_option(cfg, parent)])]
    tp = _base_type(found[0]) if found else None
    return [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []


def unknown_key(path: str, cfg: Any = None) -> ConfigError:
    known = _known_keys(path, cfg)
    hint = f"; the keys there are {', '.join(known)}" if known else ""
    parent, _, name = path.rpartition(".")
    if parent in OPTION_SCHEMAS and (chosen := _option(cfg, parent)) is not None:
        # Another option's key (a preset's data.frames under data=latents): name the options that have it.
        owners = [o for o, schema in OPTION_SCHEMAS[parent].items() if o != chosen and name in {f.name for f in dataclasses.fields(schema)}]
        if owners:
            return ConfigError(f"{path} is a key of {' and '.join(f'{parent}={o}' for o in owners)}, not of {parent}={chosen}{hint} "
                               f"(a preset such as +experiment=... may set it for its own {parent}).")
    return ConfigError(f"{path} is not a config key{hint}; check its spelling "
                       "(`python -m train --help` lists every key).")


def config_error(err: BaseException, cfg: Any = None) -> ConfigError:
    """An OmegaConf or Hydra composition error as one sentence naming the key and what it accepts."""
    cause = err
    while not isinstance(cause, OmegaConfBaseException) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        path = str(cause.full_key)
        if isinstance(cause, (ConfigKeyError, AttributeError)) or "not in struct" in str(cause) or "not in '" in str(cause):
            append = re.search(r"To append to your config use (\+.+)", str(err))  # the override to the line's end
            parent = schema_for(path.rsplit(".", 1)[0], cfg) if "." in path else None
            if append and parent and _base_type(parent[0]) is dict:
                plus = append.group(1).strip()
                plus = f"'{plus}'" if re.search(r"[\s{}\[\]]", plus) else plus  # as the shell must be given it
                return ConfigError(f"{path} is not in {path.rsplit('.', 1)[0]} yet; add it with a plus: {plus}.")
            return unknown_key(path, cfg)
        if isinstance(cause, ValidationError):
            return wrong_type(path, cause.value if hasattr(cause, "value") else None, cfg)
    text = str(err).split("Config search path")[0]
    text = " ".join(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("See https"))
    text = text.replace("Available options in", "; available options in").replace(" ;", ";")
    return ConfigError(text.rstrip(".") + ".")


# The checks.


def _typed(cfg: Any) -> DictConfig:
    """`cfg` merged over the schema (refusing wrong types and unknown keys)."""
    plain = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=False)
    plain = {k: v for k, v in plain.items() if k != "hydra"}
    try:
        typed = OmegaConf.merge(OmegaConf.structured(Config), plain)
        for section, options in OPTION_SCHEMAS.items():
            node = plain.get(section)
            if node is None:
                continue
            name = node.get("name") if isinstance(node, dict) else None
            if name not in options:
                choices = ", ".join(f"{section}={o}" for o in options)
                raise ConfigError(f"{section}.name={name!r} is unknown; choose {choices}.")
            try:
                OmegaConf.merge(OmegaConf.structured(options[name]), node)
            except OmegaConfBaseException as err:
                err.full_key = f"{section}.{err.full_key}"
                raise
    except OmegaConfBaseException as err:
        raise config_error(err, OmegaConf.create(plain)) from None
    return typed


def _check_ranges(cfg: Any, cls: type, prefix: str) -> None:
    for name, f in _fields(cls).items():
        path, meta = f"{prefix}{name}", dict(f.metadata)
        if name not in cfg or (isinstance(cfg, DictConfig) and OmegaConf.is_missing(cfg, name)):
            continue
        value = cfg[name]
        if dataclasses.is_dataclass(_base_type(f.type)):
            _check_ranges(value, _base_type(f.type), f"{path}.")
            continue
        if value is None:
            continue
        values = list(value) if isinstance(value, (list, ListConfig)) else [value]
        if meta.get("length") is not None and len(values) != meta["length"]:
            raise ConfigError(f"{path}={OmegaConf.to_container(value) if isinstance(value, ListConfig) else value!r} has "
                              f"{len(values)} values; it must have exactly {meta['length']}, each {describe_range(meta)}"
                              f"{_example(path, meta)}.")
        for v in values:
            if meta.get("choices") and v not in meta["choices"]:
                raise out_of_range(path, value, meta)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not in_range(v, meta):
                raise out_of_range(path, value, meta)


def check_config(cfg: Any) -> None:
    """Refuse a config with a wrong type, unknown key, value out of range or unfit backbone kwargs (ConfigError)."""
    try:
        typed = _typed(cfg)
    except ConfigError:
        _check_finetune_objective(cfg)  # the cause, when a preset's flow keys are what the objective refused
        raise
    _check_ranges(typed, Config, "")
    for section, options in OPTION_SCHEMAS.items():
        if typed[section] is not None:
            _check_ranges(typed[section], options[typed[section].name], f"{section}.")
    _check_trackers(typed.trainer.log_with)
    _check_cuda_graphs(typed.trainer)
    _check_resume(typed.resume)
    _check_backbone(typed.backbone)
    _check_routing(typed.routing)
    check_align(typed)
    _check_finetune(typed)
    fid = typed.fid
    if fid.every and typed.data is not None and typed.data.name == "videos":
        raise ConfigError("fid.every > 0 scores images with Inception, but data=videos trains a video model; set fid.every=0.")
    if fid.every and not fid.ref:
        raise ConfigError("fid.ref is not set but fid.every > 0: pass fid.ref=/path/to/ref.npz (mu, sigma) or a folder of real images, or fid.every=0.")
    for key_ in ("ref", "inception"):
        if fid.every and fid[key_]:
            if not Path(str(fid[key_])).expanduser().exists():
                raise ConfigError(f"fid.{key_}={fid[key_]!r} does not exist; pass an existing file or folder (or fid.every=0 to turn FID off).")


def check_overrides(overrides: list[str]) -> None:
    """Refuse a command-line value that Hydra would quietly turn into a bool (trainer.ema_warmup=2 becomes true)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return  # a malformed override: composing reports it
    for override in parsed:
        if override.key_or_group == "bench":  # configs/bench/ is the benchmark's group, beside the trainer's
            raise ConfigError(f"{override.input_line} configures the benchmark, not a training run; run "
                              f"`python -m train.bench {override.input_line.lstrip('+')}` (docs/benchmarks.md).")
        if override.is_delete() or override.is_sweep_override():
            continue
        found = schema_for(override.key_or_group)
        if found is not None and _base_type(found[0]) is bool and not isinstance(override.value(), bool):
            raise wrong_type(override.key_or_group, override.value())


def check_choices(overrides: list[str], cfg: Any) -> None:
    """Refuse a config group option that the composed config no longer honours: routing=sprint (or sprint_finetune)
    when fine-tuning a pretrained model, which has no fusion layer for SPRINT's route; under a finetune preset
    (+experiment=finetune_*) the preset's routes would replace SPRINT's and the run would train structured TREAD in
    silence, so the option itself is refused, as an explicit SPRINT route is (train/build.py)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    family = OmegaConf.select(cfg, "finetune.family", default=None)
    if not family:
        return
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 -- a malformed override: composing reports it
        return
    for override in parsed:
        option = None if override.key_or_group != "routing" or override.is_delete() else str(override.value())
        if option is not None and option.startswith("sprint"):
            replaced = "" if _fusing(OmegaConf.to_container(cfg.routing.routes)) else (
                " (and the finetune preset's routes replace SPRINT's, which would train structured TREAD instead)")
            raise ConfigError(f"{override.input_line} trains SPRINT, whose fusion layer the pretrained {family} model "
                              f"(finetune.family={family}) does not have{replaced}; fine-tune with TREAD routes "
                              "(routing=random or routing=structured).")


def _check_trackers(value: Any) -> None:
    import importlib.util

    names = list(value) if isinstance(value, (list, ListConfig)) else value
    if not (names is None or isinstance(names, str) or (isinstance(names, list) and all(isinstance(n, str) for n in names))):
        raise ConfigError(f"trainer.log_with={value!r} is neither a tracker name nor a list of them (e.g. trainer.log_with=[tensorboard,wandb]).")
    for name in tracker_list(names):
        if name not in TRACKERS:
            raise ConfigError(f"trainer.log_with={name!r} is unknown; choose none or one or more of {', '.join(TRACKERS)} "
                              "(e.g. trainer.log_with=[tensorboard,wandb]).")
        if importlib.util.find_spec(TRACKERS[name]) is None and not (name == "tensorboard" and importlib.util.find_spec("tensorboardX")):
            raise ConfigError(f"trainer.log_with={name} needs the {TRACKERS[name]} package; `pip install {TRACKERS[name]}`, or drop it "
                              "(trainer.log_with=none keeps metrics.jsonl only).")


def _check_cuda_graphs(t: DictConfig) -> None:
    """CUDA graphs capture the whole compiled network: with any other trainer.compile they would never be used."""
    mode = {True: "blocks", False: "off"}.get(t.compile, t.compile)  # configs written before the modes said true / false
    if t.cuda_graphs and mode != "model":
        raise ConfigError(f"trainer.cuda_graphs=true captures the whole compiled network, but trainer.compile={mode}, so no graph "
                          "would be used; set trainer.compile=model, or trainer.cuda_graphs=false.")


def _check_resume(resume: Any) -> None:
    if resume is None or isinstance(resume, bool) or str(resume) in ("auto", "latest", "true", "false"):
        return
    if not isinstance(resume, str):
        raise ConfigError(f"resume={resume!r} is not understood; use resume=auto, resume=true or a checkpoint folder (e.g. resume=runs/X/checkpoints/step_0000100).")


def _check_finetune_objective(cfg: Any) -> None:
    """Fine-tuning trains with flow. A preset's flow settings (objective.shift) are not keys of another objective, so
    `objective=edm` with a preset fails the objective's schema first; this names the cause instead."""
    plain = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=False)
    family = (plain.get("finetune") or {}).get("family") if isinstance(plain.get("finetune"), dict) else None
    objective = plain.get("objective")
    name = objective.get("name", "edm") if isinstance(objective, dict) else "edm"
    if family is not None and name != "flow":
        raise ConfigError(f"fine-tuning trains with rectified flow, but objective={name}; add objective=flow.")


def _check_finetune(cfg: DictConfig) -> None:
    """What fine-tuning needs: a local pretrained folder, rectified flow, a prompt table for the text families."""
    f = cfg.finetune
    # Captioned data has its own checks (train/data/captions.py, videos.py); its captions replace the prompt table.
    captions = cfg.data is not None and cfg.data.get("name") in ("captions", "videos")
    if f.family is None:
        stray = [k for k in ("pretrained", "prompts") if f[k] is not None]
        if stray:
            raise ConfigError(f"finetune.{stray[0]} is set but finetune.family is null; set finetune.family={'|'.join(FAMILIES)} "
                              f"(or +experiment=finetune_flux), or drop finetune.{stray[0]}.")
        return
    from backbones.adapters import TARGET_PRESETS, pretrained_folder  # torch and the adapters load only for a fine-tuning config

    name = f"finetune.family={f.family}"
    if f.pretrained is None:
        raise ConfigError(f"{name} needs finetune.pretrained=<local folder of the diffusers model or its pipeline> "
                          "(e.g. finetune.pretrained=weights/FLUX.1-dev); nothing is downloaded at run time.")
    pretrained_folder(f.family, f.pretrained, what="finetune.pretrained")  # a missing folder: one sentence naming what to fetch
    objective = (cfg.objective or {}).get("name", "edm")
    if objective != "flow":
        raise ConfigError(f"fine-tuning trains with rectified flow, but objective={objective}; add objective=flow.")
    if f.family == "wan" and cfg.data.get("name") != "videos":
        raise ConfigError(f"finetune.family=wan trains on video clips, not data={cfg.data.get('name')}; add data=videos data.path=<folder of "
                          "clips with captions> (or +experiment=finetune_wan).")
    encode = f"python -m train.encode_prompts --family {f.family} --pipeline DIR --prompts ... --out FILE"
    if captions and f.prompts is not None:
        raise ConfigError(f"data={cfg.data.name} conditions each sample on its own caption, encoded into the data's cache; drop finetune.prompts.")
    if f.family in TEXT_FAMILIES and f.prompts is None and not captions:
        raise ConfigError(f"{name} conditions on text; give finetune.prompts=<prompt table, one prompt per class> (write one with `{encode}`).")
    if f.family not in TEXT_FAMILIES and f.prompts is not None:
        raise ConfigError(f"{name} takes class labels itself; drop finetune.prompts.")
    if f.prompts is not None and not Path(str(f.prompts)).expanduser().is_file():
        raise ConfigError(f"finetune.prompts={f.prompts!r} does not exist; write the prompt table with `{encode}`.")
    targets = f.lora.targets
    listed = isinstance(targets, (list, ListConfig))
    if not (targets in TARGET_PRESETS if isinstance(targets, str) else listed and len(targets) and all(isinstance(t, str) and t for t in targets)):
        raise ConfigError(f"finetune.lora.targets={targets!r} is neither a preset ({', '.join(TARGET_PRESETS)}) nor a list of layer "
                          "names; e.g. finetune.lora.targets=attention_mlp or finetune.lora.targets=[to_q,to_k,to_v,proj_mlp].")
    if f.guidance != 1.0 and f.family != "flux":
        raise ConfigError(f"finetune.guidance={f.guidance:g} is Flux's distilled guidance, but {name} has none; drop finetune.guidance "
                          "(use sample.guidance for classifier-free guidance).")
    if f.family == "wan" and "resolution" in (f.train_shift, f.sample_shift):
        raise ConfigError("finetune.train_shift/sample_shift=resolution is Flux's shift by image-token count; Wan samples with a fixed "
                          "shift (objective.shift, 3 at 480p and 5 at 720p in WanPipeline): use fixed or none.")
    if f.train == "full" and f.dtype != "fp32":
        raise ConfigError(f"finetune.train=full trains every weight, which stays fp32; set finetune.dtype=fp32 "
                          "(trainer.mixed_precision=bf16 still computes in bf16).")
    if f.dtype == "bf16" and cfg.trainer.mixed_precision != "bf16":
        raise ConfigError("finetune.dtype=bf16 keeps the base weights in bf16, which needs bf16 autocast; add trainer.mixed_precision=bf16.")
    if f.dtype == "bf16" and cfg.routing.fp32_after_route:
        raise ConfigError("routing.fp32_after_route=true runs a block in fp32, which bf16 base weights (finetune.dtype=bf16) cannot; "
                          "drop it, or keep the base in fp32 (finetune.dtype=fp32) with trainer.mixed_precision=bf16.")
    if cfg.trainer.compile not in (False, None, "off"):
        raise ConfigError(f"trainer.compile={cfg.trainer.compile} is not supported with {name} (only our own backbones compile per block); "
                          "drop trainer.compile.")


def _check_backbone(b: DictConfig) -> None:
    from backbones import family_module

    module = family_module(b.name)
    if b.preset not in module.PRESETS:
        raise ConfigError(f"backbone.preset='{b.preset}' is unknown for {b.name}; choose one of {list(module.PRESETS)}.")
    params = inspect.signature(module.Block.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    fixed = list(params)[:4]  # self, width, layer_idx, depth: the skeleton passes them
    allowed = [n for n in params if n not in fixed and params[n].kind is not params[n].VAR_KEYWORD]
    kwargs = OmegaConf.to_container(b.kwargs) or {}
    for name, value in kwargs.items():
        if name in ("hidden_size", "depth"):
            raise ConfigError(f"backbone.kwargs.{name} is set; use backbone.{name}={value} instead.")
        if name not in allowed and not takes_any:
            raise ConfigError(f"backbone.kwargs.{name} is not an argument of the {b.name} block; it takes {', '.join(allowed) or 'none'} "
                              f"(e.g. +backbone.kwargs.{allowed[0] if allowed else 'name'}=...).")
        want = _annotated(params[name]) if name in params else None
        if want is not None and value is not None and (not isinstance(value, want) or (want is not bool and isinstance(value, bool))):
            raise ConfigError(f"backbone.kwargs.{name}={value!r} is not {_type_name(float if want == (int, float) else want)} "
                              f"(the {b.name} block's {name} is {params[name].annotation}).")
        meta = {**KWARG_RANGES.get(name, {}), "choices": KWARG_CHOICES.get(name)}
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (numeric and not in_range(value, meta)) or (meta["choices"] and value not in meta["choices"]):
            raise out_of_range(f"backbone.kwargs.{name}", value, meta)
    spec = {**module.PRESETS[b.preset], **{k: v for k, v in (("depth", b.depth), ("hidden_size", b.hidden_size)) if v is not None}, **kwargs}
    heads, width = spec.get("num_heads"), spec.get("hidden_size")
    if isinstance(heads, int) and isinstance(width, int):
        where = "backbone.kwargs.num_heads" if "num_heads" in kwargs else f"{b.name}-{b.preset}'s num_heads"
        if heads < 1 or width % heads:
            raise ConfigError(f"{where}={heads} does not divide the width {width} (backbone.hidden_size); "
                              f"choose a head count that divides it (e.g. +backbone.kwargs.num_heads={_divisor(width)}).")


def _annotated(param: inspect.Parameter) -> Any:
    """int, (int, float), bool or str for a parameter annotated so (as a type or, postponed, as its name); else None."""
    name = param.annotation if isinstance(param.annotation, str) else getattr(param.annotation, "__name__", "")
    return {"int": int, "float": (int, float), "bool": bool, "str": str}.get(name)


def _check_routing(r: DictConfig) -> None:
    """policy_kwargs that the policy takes, of the types it takes (routing/ checks the routes themselves)."""
    from routing.policy import POLICIES

    if r.policy not in POLICIES:
        return  # build_policy names the policies
    params = {name: p for name, p in inspect.signature(POLICIES[r.policy].__init__).parameters.items()
              if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}  # object.__init__ takes none
    takes = ", ".join(params) or "none"
    for name, value in (OmegaConf.to_container(r.policy_kwargs) or {}).items():
        if name not in params:
            raise ConfigError(f"routing.policy_kwargs.{name} is not an argument of the {r.policy!r} policy; it takes {takes}.")
        want = _annotated(params[name])
        if want is not None and (not isinstance(value, want) or (want is not bool and isinstance(value, bool))):
            raise ConfigError(f"routing.policy_kwargs.{name}={value!r} is not {_type_name(float if want == (int, float) else want)}.")


def _divisor(width: int) -> int:
    return next(h for h in (8, 6, 4, 3, 2, 1) if width % h == 0)


# Resume.


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out
    return {prefix.rstrip("."): node}


def resume_changes(saved: Any, current: Any) -> tuple[list[str], list[str]]:
    """Keys that differ between a checkpoint's config and this run's: (refused, applied), as 'key: old -> new'.

    A key refuses a change when its schema field says on_resume=REFUSE (the value changes what the saved
    weights mean, e.g. edm.sigma_data); every other change is applied by the resumed run. Keys the
    checkpoint predates are not changes.
    """
    to_plain = lambda c: OmegaConf.to_container(c, resolve=True) if isinstance(c, (DictConfig, ListConfig)) else c  # noqa: E731
    old, new = _flat(_as_built(to_plain(saved))), _flat(_as_built(to_plain(current)))
    refused, applied = [], []
    for path in sorted(new):
        if path.split(".")[0] in RUN_KEYS or path.startswith("hydra.") or path not in old or old[path] == new[path]:
            continue
        if path == "routing.routes" and _fusing(old[path], new[path]):
            more_refused, more_applied = _sprint_route_changes(old[path], new[path])
            refused, applied = refused + more_refused, applied + more_applied
            continue
        section = path.split(".")[0]
        found = schema_for(path, current)
        rule = REFUSE if section in OPTION_SCHEMAS else (found[1].get("on_resume", APPLY) if found else APPLY)
        (refused if rule == REFUSE else applied).append(f"{path}: {old[path]!r} -> {new[path]!r}")
    return refused, applied


def _as_built(cfg: Any) -> Any:
    """The config as the model is built from it: the backbone's null sizes as its preset's, and each route's negative
    layer indices (and align's blocks) counted from the end, so the same model written two ways is no change
    (end_layer_idx -3 and 5 on depth 8). A fine-tuned model's depth is its pretrained checkpoint's, unknown here: its routes stay as written."""
    if not isinstance(cfg, dict) or not isinstance(cfg.get("backbone"), dict):
        return cfg
    backbone = resolved_backbone(cfg["backbone"])
    depth = None if (cfg.get("finetune") or {}).get("family") else backbone.get("depth")
    out = {**cfg, "backbone": backbone}
    if not isinstance(depth, int):
        return out
    at = lambda i: i + depth if isinstance(i, int) and not isinstance(i, bool) and i < 0 else i  # noqa: E731
    routing, align = cfg.get("routing"), cfg.get("align")
    if isinstance(routing, dict) and isinstance(routing.get("routes"), list):
        routes = [{**r, **{k: at(r[k]) for k in ("start_layer_idx", "end_layer_idx") if k in r}} if isinstance(r, dict) else r
                  for r in routing["routes"]]
        out["routing"] = {**routing, "routes": routes}
    if isinstance(align, dict):  # the aligned and teacher blocks count from the end the same way
        align = {**align, **{k: at(align[k]) for k in ("layer", "teacher_layer") if k in align}}
        if align.get("name") == "none":  # no alignment: its other keys build nothing, so a refusal names the mode alone
            align = {"name": "none"}
        out["align"] = _align_as_built(align, depth, backbone.get("hidden_size")) if align.get("name") in ("repa", "self") else align
    return out


def _align_as_built(align: dict, depth: int, hidden_size: Any) -> dict:
    """An alignment as the run built it, so a refusal names values, never None: the head, its width and the loss for null
    are the mode's own, self's null blocks SRA's at this depth. A config saved before align.head existed (2026-11-26)
    built REPA's projector in every mode: its missing head is repa (a resume with today's align=self then names
    `align.head: 'repa' -> 'sra'` instead of failing on the projector's weights)."""
    from backbones.align import DEFAULT_HEAD, DEFAULT_LOSS, head_width, sra_blocks

    name, out = align["name"], dict(align)
    out["head"] = align.get("head", "repa") or DEFAULT_HEAD[name]
    out["loss"] = align.get("loss") or DEFAULT_LOSS[name]
    if isinstance(hidden_size, int) and out["head"] in DEFAULT_HEAD.values():
        out["projector_width"] = head_width(out["head"], hidden_size, align.get("projector_width"))
    if name == "self" and depth >= 2:
        student, teacher = sra_blocks(depth)
        out["layer"] = student if align.get("layer") is None else align["layer"]
        out["teacher_layer"] = teacher if align.get("teacher_layer") is None else align["teacher_layer"]
    return out


def _fusing(*route_lists) -> bool:
    return any(isinstance(r, dict) and r.get("mode") == "sprint" for routes in route_lists for r in routes or [])


def _sprint_route_changes(old: list, new: list) -> tuple[list[str], list[str]]:
    """On resume a SPRINT route may change its selection_ratio (the second stage, a full-token fine-tune, sets 0)
    and its path_drop; its blocks and kind may not, because the fusion layer belongs to that split of the stack."""
    layout = lambda routes: [(r.get("start_layer_idx"), r.get("end_layer_idx"), r.get("mode", "tread")) for r in routes]  # noqa: E731
    if layout(old) != layout(new):
        return [f"routing.routes: the SPRINT route layout (start, end, mode) {layout(old)} -> {layout(new)} "
                "(its fusion layer belongs to those blocks; change only selection_ratio or path_drop)"], []
    changes = []
    for k, (a, b) in enumerate(zip(old, new)):
        for key in ("selection_ratio", "path_drop"):
            if a.get(key, 0.0) != b.get(key, 0.0):
                note = " (SPRINT's second stage: every token runs the middle; the fusion is kept)" \
                    if key == "selection_ratio" and b.get(key) == 0 else ""
                changes.append(f"routing.routes[{k}].{key}: {a.get(key, 0.0)!r} -> {b.get(key, 0.0)!r}{note}")
    return [], changes
