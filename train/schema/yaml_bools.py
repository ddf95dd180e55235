"""Refuse a boolean key given as a string in a YAML file (`trainer.cpu: "true"`, `trainer.ema_warmup: 'off'`).

OmegaConf converts such a string when it merges the file over the schema's bool field, so after composition nothing
shows that the file held text: "false", "no" and "off" all quietly become False. The command line is checked by
`check_overrides`; the files are checked here, as Hydra loads them (the same defaults list, the same packages),
before the merge. Hydra's loader is not public API: if it changes shape, this check steps aside (returns) rather
than refuse a valid config.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from routing.errors import ConfigError
from train.schema.check import _base_type, schema_for


def _strings(node: Any, prefix: str):
    """(dotted path, value) of every string leaf of a raw YAML node (the `defaults` list skipped)."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            if prefix == "" and key == "defaults":
                continue
            path = f"{prefix}.{key}" if prefix else str(key)
            child = node._get_node(key)  # noqa: SLF001 -- the raw node: unresolved, not converted
            if isinstance(child, (DictConfig, ListConfig)):
                yield from _strings(child, path)
            elif isinstance(child._value(), str) and not OmegaConf.is_interpolation(node, key):  # noqa: SLF001
                yield path, child._value()  # noqa: SLF001


def check_yaml_booleans(config_name: str, overrides: list[str], cfg: Any = None) -> None:
    """Raise ConfigError for the first bool key of the schema that a YAML file of this composition gives as a string.

    Call inside Hydra's `initialize_config_dir` context, after `compose` succeeded; `cfg`, the composed config, picks
    the schema of the data and objective options."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    try:
        loader = GlobalHydra.instance().config_loader()
        _, repo = loader._parse_overrides_and_create_caching_repo(config_name, overrides)  # noqa: SLF001
        defaults = loader.compute_defaults_list(config_name, overrides, RunMode.RUN).defaults
        loaded = []
        for default in defaults:
            if default.config_path is None or default.config_path.startswith("hydra/"):
                continue
            result = repo.load_config(default.config_path)
            if result is None or result.provider == "schema":  # the typed dataclasses: already bools
                continue
            loaded.append((default, result))
    except Exception:  # noqa: BLE001 -- Hydra's internals moved: composing already succeeded, so accept
        return
    for default, result in loaded:
        for path, value in _strings(result.config, default.package or ""):
            found = schema_for(path, cfg)
            if found is not None and _base_type(found[0]) is bool:
                where = result.path.removeprefix("file://") + "/" + default.config_path + ".yaml"
                raise ConfigError(f"{path}: {value!r} in {where} is quoted text, not a boolean (OmegaConf would convert it in "
                                  f"silence); write {path.rsplit('.', 1)[-1]}: true or {path.rsplit('.', 1)[-1]}: false, without quotes.")
