"""The typed config schema: one dataclass per config group, registered with Hydra's ConfigStore.

configs/config.yaml lists `base_config` first in its defaults, so every value the YAML files and the
command line give is merged over these dataclasses: Hydra refuses a wrong type or an unknown key when it
composes, and `check_config` checks ranges, choices, per-dataset and per-objective keys and the backbone
family's keyword arguments before any work starts. A new key is one `key(...)` field (train/schema/keys.py).

This wing imports nothing else from train (the import contracts in pyproject.toml).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from train.schema.check import (check_choices, check_config, check_overrides, config_error, numeric_keys,
                                resume_changes, schema_for)
from train.schema.backbone import resolved_backbone
from train.schema.config import Config
from train.schema.help import help_template
from train.schema.keys import APPLY, REFUSE, key


def register() -> None:
    """Make `base_config` and the `--help` text known to Hydra (idempotent; done on import)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    store.store(group="hydra/help", name="schema", node={"app_name": "python -m train", "header": "", "footer": "",
                                                         "template": help_template()})


register()

__all__ = ["APPLY", "REFUSE", "Config", "check_choices", "check_config", "check_overrides", "config_error", "key",
           "numeric_keys", "register", "resolved_backbone", "resume_changes",
           "schema_for"]
