"""Captioned image folders (`data=captions`): `name.png` beside `name.txt`, as SimpleTuner and kohya lay them out.

`list_captioned(folder)` finds every image under the folder (sub-folders included) with its caption and size,
and refuses, in one sentence naming the file and the fix, a folder without images, an image without a caption
file or with an empty one, an image PIL cannot open, and a force-keep mask (`name.mask.png`, masks.py) of the
wrong size or mode or beside no image. The captions are encoded and the images turned into
latents once, into a cache (caption_cache.py); `CaptionsDataset` trains from that cache.

Conditioning reuses the class-prompt path: each distinct caption is a row of a prompt table (row K is the empty
caption), and an image's "label" is its caption's row. So caption dropout for classifier-free guidance is the
trainer's label dropout (edm.label_dropout), which replaces a caption with the empty one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from routing.errors import ConfigError
from train.data.images import IMAGE_EXTENSIONS, image_files
from train.data.masks import check_mask, check_orphans, check_sample_weights, check_weights, is_mask_file, mask_file

# What PIL raises for truncated, corrupt or hostile files.
UNREADABLE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


@dataclass(frozen=True)
class Captioned:
    file: str  # path relative to the folder, posix
    caption: str
    size: tuple[int, int]  # (width, height) in pixels
    stamp: tuple[int, int]  # (bytes, mtime in ns): a changed image invalidates its latents


def read_caption(item: Path, text_file: Path | None = None, kind: str = "image") -> str:
    """The caption of an image (or a clip: `kind`) from its sidecar text file (default: the item's name with .txt)."""
    text_file = text_file or item.with_suffix(".txt")
    if not text_file.is_file():
        raise ConfigError(f"{kind} '{item}' has no caption file; write its caption to '{text_file}' (one line of text), "
                          f"or move the {kind} out of data.path.")
    try:
        caption = " ".join(text_file.read_text(encoding="utf-8").split())
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"caption file '{text_file}' is unreadable ({type(err).__name__}); save it again as UTF-8 text.") from None
    if not caption:
        raise ConfigError(f"caption file '{text_file}' is empty; write the {kind}'s caption into it, or move the {kind} out of "
                          "data.path.")
    return caption


def image_size(image: Path) -> tuple[int, int]:
    try:
        with Image.open(image) as opened:
            opened.verify()  # reads the whole file's structure without decoding the pixels
        with Image.open(image) as opened:
            return opened.size
    except UNREADABLE as err:
        raise ConfigError(f"image '{image}' is unreadable ({type(err).__name__}); replace or delete it.") from None


TEXT_FAMILIES = ("flux", "sd3", "pixart")


def check_captions(cfg) -> list[Captioned]:
    """Every refusal of a `data=captions` run before any work: the model it needs, then the folder (list_captioned)."""
    from omegaconf import OmegaConf

    family = (cfg.get("finetune") or {}).get("family")
    if family not in TEXT_FAMILIES:
        raise ConfigError(f"data=captions conditions a text-to-image model on its captions, but finetune.family={family}; fine-tune "
                          f"one of {', '.join(TEXT_FAMILIES)} (e.g. +experiment=finetune_flux finetune.pretrained=weights/FLUX.1-dev).")
    if OmegaConf.is_missing(cfg.data, "path") or not cfg.data.path:
        raise ConfigError("data=captions needs data.path=<folder of images with a .txt caption beside each>.")
    if cfg.data.channels not in (1, 3):
        raise ConfigError(f"data.channels={cfg.data.channels} is neither 3 (RGB) nor 1 (grey); choose one of them.")
    check_weights(cfg.data.get("mask_loss_weight"))
    items = list_captioned(cfg.data.path)
    root = Path(cfg.data.path).expanduser()
    for item in items:
        if mask_file(root / item.file).is_file():
            check_sample_weights(root / item.file, [mask_file(root / item.file)], cfg.data.get("mask_loss_weight"))
    return items


def list_captioned(folder: str | Path) -> list[Captioned]:
    """Every image under `folder` with its caption, size and file stamp, in sorted path order."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.path='{root}' is not a folder; point it at a folder of images with a .txt caption beside each.")
    files = [f for f in image_files(root) if not is_mask_file(f)]  # name.mask.png is name.png's mask, not an image
    if not files:
        raise ConfigError(f"data.path='{root}' holds no images ({', '.join(IMAGE_EXTENSIONS)}); add images with a .txt caption "
                          "beside each (name.png + name.txt).")
    out = []
    for file in files:
        caption = read_caption(file)
        stat, size = file.stat(), image_size(file)
        if mask_file(file).is_file():
            check_mask(mask_file(file), size, file)
        out.append(Captioned(file.relative_to(root).as_posix(), caption, size, (stat.st_size, stat.st_mtime_ns)))
    check_orphans(root, files)
    return out
