"""Validation prompts: what a text-to-image fine-tune's preview grids show, one row per prompt (SimpleTuner's validation
prompts), and what `python -m train.sample --prompts-file` samples.

`sample.prompts` is a list of texts or the path of a UTF-8 text file with one prompt per line (blank lines skipped).
At set-up the prompts are encoded once, with the text encoders the run is conditioned with and at its training text
length, into a prompt table of their own (row P: the empty prompt, CFG's unconditional branch). A preview swaps that
table into the EMA model for its grid and puts the training table back, so training never sees the prompts. A preview
shows at most PREVIEW_PROMPTS of them (the first; one line says so), so a long file costs neither minutes per preview
nor a grid of thousands of rows; `python -m train.sample --prompts-file` samples every line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import ListConfig

from backbones.adapters import TABLE_KEYS
from routing.errors import ConfigError
from train.data.prompts import PromptTable, check_table, encode_table

KEY = "sample.prompts"
PREVIEW_PROMPTS = 16  # rows of a preview grid; more are cut, in one line
EXAMPLE = 'sample.prompts=["a photo of sks dog","sks dog on a beach"]'


def read_prompts_file(path, key: str) -> list[str]:
    """The prompts of a text file, one per line, blank lines skipped; refused in one sentence naming `key`."""
    file = Path(str(path)).expanduser()
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "does not exist"
        raise ConfigError(f"{key}='{path}' {what}; give a text file with one prompt per line.")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{key}='{path}' is not UTF-8 text; save it as UTF-8 text with one prompt per line.") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"{key}='{path}' holds no prompt (it is empty or blank); write one prompt per line.")
    return prompts


def require_text_family(cfg, key: str, fix: str) -> str:
    """The fine-tuned text family of the run; refused in one sentence when the run takes class labels."""
    family = (cfg.get("finetune") or {}).get("family")
    if family not in TABLE_KEYS:
        raise ConfigError(f"{key} gives text prompts, which only a fine-tuned text-to-image model takes (finetune.family: "
                          f"{', '.join(TABLE_KEYS)}), but this run is class-conditional (finetune.family={family}); {fix}.")
    return family


def validation_prompts(cfg) -> list[str] | None:
    """sample.prompts as a list of texts (None when unset); every refusal names the key and its fix."""
    value = (cfg.get("sample") or {}).get("prompts")
    if value is None:
        return None
    require_text_family(cfg, KEY, "drop sample.prompts (the previews show one row per class)")
    if isinstance(value, str):
        return read_prompts_file(value, KEY)
    items = list(value) if isinstance(value, (list, tuple, ListConfig)) else None
    if items is None or not all(isinstance(p, str) for p in items):
        raise ConfigError(f"{KEY}={value!r} is neither a list of texts nor the path of a text file; quote each prompt "
                          f"(e.g. {EXAMPLE}).")
    prompts = [p.strip() for p in items]
    if not prompts or not all(prompts):
        raise ConfigError(f"{KEY} holds no prompt or an empty one; give non-empty texts (e.g. {EXAMPLE}), or drop the key.")
    return prompts


def text_pipeline(cfg) -> Path:
    """The pipeline folder whose text encoders condition the run: a captioned folder's (data.pipeline or
    finetune.pretrained; its own checks refuse a wrong one), or a prompt table's source, else finetune.pretrained."""
    f = cfg.finetune
    if cfg.data.name in ("captions", "videos"):
        return Path(str(cfg.data.get("pipeline") or f.pretrained)).expanduser()
    header = check_table(f.prompts, f.family)
    for folder in ([] if header.stand_in else [header.source]) + [f.pretrained]:
        if (Path(str(folder)).expanduser() / "model_index.json").is_file():
            return Path(str(folder)).expanduser()
    raise ConfigError(f"{KEY} needs the text encoders this run is conditioned with, but its prompt table '{f.prompts}' is a random "
                      f"stand-in and finetune.pretrained='{f.pretrained}' is not a pipeline folder; drop sample.prompts (the "
                      "previews show the table's first classes).")


def check_validation_prompts(cfg) -> None:
    """Every refusal of sample.prompts before any work: the value, the file, the run's family and its text encoders."""
    if validation_prompts(cfg) is not None:
        text_pipeline(cfg)


def encode_validation(cfg, model, device, log=print) -> PromptTable | None:
    """sample.prompts encoded as the run's training conditioning is (`model`: its PromptConditioned, whose table gives
    the text length); None when unset."""
    prompts = validation_prompts(cfg)
    if prompts is None:
        return None
    folder = text_pipeline(cfg)
    if len(prompts) > PREVIEW_PROMPTS:
        log(f"{KEY}: {len(prompts)} prompts; the previews show the first {PREVIEW_PROMPTS}, one row each "
            f"(python -m train.sample --prompts-file samples them all)")
        prompts = prompts[:PREVIEW_PROMPTS]
    log(f"{KEY}: encoding {len(prompts)} validation prompts for the previews with the text encoders of {folder}")
    return encode_table(cfg.finetune.family, folder, prompts, device=str(device), dtype=cfg.finetune.dtype,
                        like=model.encoder_hidden_states)


@contextmanager
def conditioned_on(model, table: PromptTable | None) -> Iterator[int | None]:
    """Condition `model` (a PromptConditioned) on `table` inside the block and yield its number of prompts P (labels
    0..P-1, null label P); the model's own table is back afterwards. With no table: nothing changes, yields None."""
    if table is None:
        yield None
        return
    kept = {name: getattr(model, name) for name in model.names}
    model.use_table(table.tensors)
    try:
        yield table.num_classes
    finally:
        model.use_table(kept)
