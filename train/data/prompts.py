"""Prompt tables: one text prompt per class, encoded once, for fine-tuning Flux, SD3, PixArt and Wan on class labels.

A table is one safetensors file (backbones/adapters/prompts.py reads it during training):
- tensors: `encoder_hidden_states` (K+1, L, D), plus `pooled_projections` (K+1, P) for flux and sd3, or
  `encoder_attention_mask` (K+1, L) for pixart (wan: the states only). Row k holds class k's prompt; row K the empty
  prompt, the null class of label dropout and classifier-free guidance;
- metadata: `format`, `family`, `prompts` (JSON list of the K+1 texts, the last one ""), `source` (the pipeline
  folder), and `stand_in` ("true" for random embeddings that no text encoder made).

`encode_table` computes it with the model's own text encoders and the pipeline's own `encode_prompt`, from a
local folder only; `random_table` writes a stand-in for tests and CPU demos.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from backbones.adapters import PRETRAINED, TABLE_KEYS
from backbones.adapters.pretrained import dtype_kwarg
from routing.errors import ConfigError
from train.files import read_config, write_atomic
from train.files.prompt_table import FORMAT, WRITE_ONE, TableHeader, read_header
# The diffusers pipelines whose `encode_prompt` makes each family's text conditioning.
PIPELINES = {"flux": ("FluxPipeline",), "sd3": ("StableDiffusion3Pipeline",), "pixart": ("PixArtSigmaPipeline", "PixArtAlphaPipeline"),
             "wan": ("WanPipeline",)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STAND_IN = "random stand-in"


@dataclass
class PromptTable:
    family: str
    tensors: dict[str, torch.Tensor]  # the names of TABLE_KEYS[family], each (K + 1, ...)
    prompts: list[str]  # K + 1 texts; the last is "" (the null class)
    source: str  # the pipeline folder, or STAND_IN
    stand_in: bool = False

    @property
    def num_classes(self) -> int:
        return len(self.prompts) - 1


def _check_family(family: str) -> None:
    if family not in TABLE_KEYS:
        raise ConfigError(f"--family {family} has no prompt table (DiT takes class labels itself); choose one of {sorted(TABLE_KEYS)}.")


def write_table(table: PromptTable, path: str | os.PathLike) -> Path:
    """Write `table` atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": FORMAT, "family": table.family, "prompts": json.dumps(table.prompts), "source": table.source,
                "stand_in": "true" if table.stand_in else "false"}
    tensors = {k: v.detach().contiguous().cpu() for k, v in table.tensors.items()}
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    return path


def check_table(path: str | os.PathLike, family: str | None = None) -> TableHeader:
    """The header of the table at `path` (tensors unread); with `family`, refuse one encoded for another family."""
    header = read_header(path)
    if family is not None and header.family != family:
        raise ConfigError(f"prompt table '{path}' was encoded for {header.family}, not {family}; encode the prompts with the "
                          f"{family} pipeline (python -m train.encode_prompts --family {family}).")
    if header.family not in TABLE_KEYS or sorted(header.shapes) != sorted(TABLE_KEYS[header.family]):
        raise ConfigError(f"prompt table '{path}' holds {sorted(header.shapes)} for family {header.family!r}, not the tensors "
                          f"of {sorted(TABLE_KEYS)}; {WRITE_ONE}.")
    return header


def read_table(path: str | os.PathLike, family: str | None = None) -> PromptTable:
    """The table at `path`; with `family`, refuse one encoded for another family."""
    header = check_table(path, family)
    try:
        tensors = load_file(Path(path).expanduser())
    except Exception as err:  # the header read, the data did not: safetensors raises several types
        raise ConfigError(f"prompt table '{path}' is unreadable ({type(err).__name__}); {WRITE_ONE}.") from None
    return PromptTable(header.family, tensors, header.prompts, header.source, header.stand_in)


def random_table(family: str, prompts: list[str], sizes: tuple[int, ...], seed: int = 0) -> PromptTable:
    """Fixed random embeddings in the table's layout: sizes (L, D) for pixart and wan, (L, D, P) for flux and sd3.

    A stand-in for tests and CPU demos with tiny random models, which have no text encoder; labelled as such.
    """
    _check_family(family)
    pooled = "pooled_projections" in TABLE_KEYS[family]
    if len(sizes) != 2 + pooled or min(sizes) < 1:
        takes, example = ("L,D,P (text tokens, text width, pooled width)", "8,64,32") if pooled else ("L,D (text tokens, text width)", "8,64")
        raise ConfigError(f"--random for {family} takes {takes} as positive integers, e.g. --random {example}.")
    g = torch.Generator().manual_seed(seed)
    rows = len(prompts) + 1
    tensors = {"encoder_hidden_states": torch.randn(rows, sizes[0], sizes[1], generator=g)}
    if pooled:
        tensors["pooled_projections"] = torch.randn(rows, sizes[2], generator=g)
    elif "encoder_attention_mask" in TABLE_KEYS[family]:
        tensors["encoder_attention_mask"] = torch.ones(rows, sizes[0], dtype=torch.long)
    return PromptTable(family, tensors, [*prompts, ""], STAND_IN, stand_in=True)


def load_text_pipeline(family: str, folder: str | os.PathLike, dtype: str = "fp32"):
    """The family's diffusers pipeline from a local folder with its text encoders and tokenizers only (no
    transformer, no VAE are loaded); never downloads."""
    _check_family(family)
    import diffusers

    folder = Path(folder).expanduser()
    index = folder / "model_index.json"
    fetch = (f"fetch its text encoders first, e.g. `huggingface-cli download {PRETRAINED[family][1]} --include "
             f"'model_index.json' 'text_encoder*/*' 'tokenizer*/*' 'scheduler/*' --local-dir {folder}`")
    if not index.is_file():
        raise ConfigError(f"pipeline folder '{folder}' holds no diffusers {PIPELINES[family][0]} (model_index.json); {fetch}.")
    name = read_config(index, fetch).get("_class_name")
    if name not in PIPELINES[family]:
        raise ConfigError(f"pipeline folder '{folder}' holds a {name}, not the {' or '.join(PIPELINES[family])} that --family {family} needs.")
    try:
        return getattr(diffusers, name).from_pretrained(folder, transformer=None, vae=None, **dtype_kwarg(DTYPES[dtype]),
                                                        local_files_only=True)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"could not load the text encoders of '{folder}' ({first.rstrip('.')}); {fetch}.") from None


@torch.no_grad()
def encode_batch(pipe, family: str, texts: list[str], device, max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
    """The pipeline's own text conditioning for `texts`, in the table's names: each (len(texts), ...)."""
    length = {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
    if family == "flux":
        embeds, pooled, _ = pipe.encode_prompt(texts, prompt_2=None, device=device, **length)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}
    if family == "wan":
        embeds, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device=device, **length)
        return {"encoder_hidden_states": embeds}
    if family == "sd3":
        embeds, _, pooled, _ = pipe.encode_prompt(texts, None, None, device=device, do_classifier_free_guidance=False, **length)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}
    embeds, mask, _, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device=device, clean_caption=False, **length)
    return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}


def encode_table(family: str, folder: str | os.PathLike, prompts: list[str], *, device: str = "cpu", dtype: str = "fp32",
                 max_sequence_length: int | None = None, batch_size: int = 16, like: torch.Tensor | None = None) -> PromptTable:
    """Encode `prompts` and the empty prompt with the text encoders of the pipeline in `folder`.

    `like`: a table's encoder_hidden_states (K + 1, L, D) whose text length the new rows must have, so that prompts
    sampled from a run are encoded exactly as its training conditioning was (SD3: CLIP's tokens, then T5's).
    """
    pipe = load_text_pipeline(family, folder, dtype).to(device)
    if like is not None:
        max_sequence_length = like.shape[1] - (pipe.tokenizer_max_length if family == "sd3" else 0)
    texts = [*prompts, ""]
    parts = [encode_batch(pipe, family, texts[i : i + batch_size], device, max_sequence_length) for i in range(0, len(texts), batch_size)]
    tensors = {name: torch.cat([p[name] for p in parts]).cpu() for name in parts[0]}
    return PromptTable(family, tensors, texts, str(folder))


def text_pipeline_of(cfg) -> Path:
    """The pipeline folder whose text encoders conditioned a fine-tuning run, for encoding new prompts to sample.

    Captioned data (images or videos): data.pipeline or finetune.pretrained. A prompt table: the pipeline it was encoded with (its
    `source`), else finetune.pretrained when that is a pipeline folder. A random stand-in has no text encoder.
    """
    f = cfg.get("finetune") or {}
    if f.get("family") not in TABLE_KEYS:
        raise ConfigError("--prompt is for runs that fine-tuned a text-conditioned model (flux, sd3, pixart, wan); this run takes "
                          "class labels: sample them with --classes.")
    candidates = []
    if cfg.data.name in ("captions", "videos"):
        candidates.append(cfg.data.get("pipeline") or f["pretrained"])
    else:
        table = read_table(f["prompts"], f["family"])
        if not table.stand_in:
            candidates.append(table.source)
        candidates.append(f["pretrained"])
    for folder in candidates:
        if (Path(str(folder)).expanduser() / "model_index.json").is_file():
            return Path(str(folder)).expanduser()
    raise ConfigError(f"--prompt needs the text encoders this run was conditioned with, but its prompt table '{f['prompts']}' is a "
                      f"random stand-in and finetune.pretrained='{f['pretrained']}' is not a pipeline folder; sample its classes instead "
                      "(--classes).")
