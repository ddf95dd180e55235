"""REPA's frozen encoder: a timm model from local files only, clean images -> patch features on the token grid.

REPA aligns a hidden state with a self-supervised encoder's patch features of the clean image (DINOv2-B in the
paper, at 224 pixels: a 16 x 16 patch grid, SiT-XL/2's token grid at 256 pixels). Here the encoder is named by
its timm name with a local weights file, or given as a local timm folder (config.json + model.safetensors, whose
config may carry model_args); nothing is downloaded. Features are computed once per clean batch, without
gradient, under bf16 autocast, and the patch grid is average-pooled onto the model's token grid, which it must
cover a whole number of times per side (else the config is refused, naming an input size that fits).
`train.cache_latents --align-encoder` stores the unpooled features beside latents (no token grid yet);
`CachedFeatures` pools them at training time, the same way.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from timm.data import resolve_model_data_config
from timm.models import get_pretrained_cfg

from routing.errors import ConfigError
from train.files import damaged, read_json, read_weights


class FrozenEncoder:
    """encoder(images) -> (B, h*w, C) float32 patch features, raster order on the model's (h, w) token grid (on the
    encoder's own patch grid when token_grid is None: what a latents cache stores).

    Not an nn.Module on purpose: its weights are frozen inputs, never part of the trained or saved state.
    images: (B, C, H, W) in [-1, 1] (the datasets' pixel space), 1 or 3 channels.
    """

    def __init__(self, model: torch.nn.Module, input_size: int, token_grid: tuple[int, int] | None, dtype: torch.dtype = torch.bfloat16):
        self.model = model.eval().requires_grad_(False)
        self.input_size, self.dtype = int(input_size), dtype
        data = resolve_model_data_config(model)
        self.in_chans = int(data["input_size"][0])
        self.mean = torch.tensor(data["mean"]).view(1, -1, 1, 1)  # (C,) -> (1, C, 1, 1)
        self.std = torch.tensor(data["std"]).view(1, -1, 1, 1)
        self.prefix = int(getattr(model, "num_prefix_tokens", 0))  # class and register tokens before the patches
        self.dim, self.grid = self._probe()
        self.token_grid = self.grid if token_grid is None else tuple(token_grid)
        check_pooling(self.grid, self.token_grid, f"align.input_size={self.input_size} gives the encoder", self.input_size)

    @classmethod
    def load(cls, name: str, weights: str, input_size: int, token_grid: tuple[int, int] | None, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.bfloat16) -> FrozenEncoder:
        """The encoder `name` with the local `weights` (a file, or a timm folder), refusing what cannot be used: a
        damaged, empty or truncated file, and weights whose keys and shapes are not exactly those of the encoder."""
        path = Path(str(weights)).expanduser()
        if not path.exists():
            raise ConfigError(f"align.weights={str(weights)!r} does not exist; put {name}'s weights there (a .safetensors or .pth state "
                              "dict, or a timm folder with config.json and model.safetensors), or pass the path where they are.")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ConfigError(f"align.weights={str(weights)!r} is a folder without config.json; give a timm folder (config.json + "
                              "model.safetensors, as timm's save_pretrained writes) or the weights file itself.")
        source, file, tensors, architecture = _local_weights(name, path)
        overlay = {"state_dict": tensors, "file": None, "source": "", "hf_hub_id": None, "url": None, "num_classes": 0}
        quiet = logging.getLogger("timm.models._builder")  # its INFO line names a state dict, not the file read above
        level = quiet.level
        quiet.setLevel(max(level, logging.WARNING))
        try:
            try:
                model = timm.create_model(source, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=0, img_size=input_size)
            except TypeError:  # an encoder without an image-size argument (a convolutional one)
                model = timm.create_model(source, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=0)
        except RuntimeError as err:
            if "Unknown model" in str(err):
                raise ConfigError(f"align.encoder={name!r} is not a timm model name; give a timm name and a weights file of that model "
                                  "(python -c 'import timm; print(timm.list_models(\"*dinov2*\"))' lists names).") from None
            if path.is_dir():
                raise damaged(file, f"does not hold the weights of the {architecture or 'model'} that config.json beside "
                                    f"it names ({_load_fault(err)})", "save the folder again (timm's save_pretrained), or point "
                                    "align.weights at the weights of the encoder meant") from None
            raise damaged(file, f"does not hold {name}'s weights ({_load_fault(err)})", f"point align.weights at {name}'s weights, "
                          "or set align.encoder to the model these belong to") from None
        finally:
            quiet.setLevel(level)
        return cls(model.to(device), input_size, token_grid, dtype)

    def _probe(self) -> tuple[int, tuple[int, int]]:
        """(feature width, the encoder's patch grid) from one forward of a blank image; refuses a non-square grid."""
        device = next(self.model.parameters()).device
        with torch.no_grad():
            out = self.model.forward_features(torch.zeros(1, self.in_chans, self.input_size, self.input_size, device=device))
        if out.ndim == 4:  # (1, C, gh, gw): a convolutional map
            dim, grid = out.shape[1], tuple(out.shape[2:])
        else:  # (1, prefix + gh * gw, C)
            dim, n = out.shape[-1], out.shape[1] - self.prefix
            grid = tuple(getattr(getattr(self.model, "patch_embed", None), "grid_size", ()) or ())
            if len(grid) != 2 or grid[0] * grid[1] != n:
                side = math.isqrt(n)
                grid = (side, side)
            if grid[0] * grid[1] != n:
                raise ConfigError(f"align.encoder's {n} patch tokens form no square grid at align.input_size={self.input_size}; "
                                  "use a ViT-style encoder with a square patch grid.")
        return int(dim), (int(grid[0]), int(grid[1]))

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[-1, 1] images -> the encoder's input: its channels, input_size pixels (bicubic), its mean and std."""
        x = images.float()
        if x.shape[1] != self.in_chans:
            if x.shape[1] != 1:
                raise ConfigError(f"align=repa got {x.shape[1]}-channel images, but the encoder takes {self.in_chans} channels; use an "
                                  "encoder for this data or align=self.")
            x = x.expand(-1, self.in_chans, -1, -1)  # grey (B, 1, H, W) -> (B, C, H, W)
        x = (x + 1) / 2
        if x.shape[-2:] != (self.input_size, self.input_size):
            x = F.interpolate(x, size=(self.input_size, self.input_size), mode="bicubic", align_corners=False)
        return (x - self.mean.to(x.device)) / self.std.to(x.device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = self.preprocess(images)
        with torch.autocast(x.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            out = self.model.forward_features(x)
        out = out.float()
        if out.ndim == 4:
            out = out.flatten(2).transpose(1, 2)  # a convolutional map (B, C, gh, gw) -> (B, gh*gw, C)
        else:
            out = out[:, self.prefix:]  # (B, P + gh*gw, C) -> (B, gh*gw, C)
        return pool_tokens(out, self.grid, self.token_grid)


class CachedFeatures:
    """features(cached) -> (B, h*w, C) on the model's token grid: an encoder's patch features stored beside latents by
    `train.cache_latents --align-encoder` (meta.json's align.features), pooled as FrozenEncoder pools its own."""

    def __init__(self, grid: tuple[int, int], dim: int, token_grid: tuple[int, int], input_size: int):
        self.grid, self.dim, self.token_grid = (int(grid[0]), int(grid[1])), int(dim), tuple(token_grid)
        check_pooling(self.grid, self.token_grid, f"the cached features (--align-input-size {input_size}) have", input_size)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        return pool_tokens(features.float(), self.grid, self.token_grid)


def _local_weights(name: str, path: Path) -> tuple[str, Path, dict[str, torch.Tensor], str | None]:
    """(timm source, weights file, its tensors without the classifier, the folder's architecture) for the encoder `name`
    with the local weights `path`, a file or a timm folder; every file read whole through the typed loaders."""
    folder = path.is_dir()
    fix = (f"align.weights takes {'this folder' if folder else name}'s weights: save them again (a .safetensors or .pth state dict "
           "of the encoder, or a timm folder with config.json and model.safetensors)")
    config = read_json(path / "config.json", fix) if folder else {}
    if not isinstance(config, dict):
        raise damaged(path / "config.json", "is not a JSON object (timm's model config)", fix)
    pretrained = (config.get("pretrained_cfg") or {}) if folder else (get_pretrained_cfg(name) or {})
    if not isinstance(pretrained, dict):
        pretrained = pretrained.to_dict()
    file = (path / "model.safetensors" if (path / "model.safetensors").is_file() else path / "pytorch_model.bin") if folder else path
    tensors = read_weights(file, fix)
    # timm drops the classifier when num_classes changes, and then loads the rest without checking that every key
    # fits; dropped here instead, timm loads strictly (after its own conversions, e.g. the position table resampled
    # to input_size), so another model's weights are refused.
    heads = pretrained.get("classifier") or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    tensors = {k: v for k, v in tensors.items() if not k.startswith(tuple(f"{h}." for h in heads))}
    return (f"local-dir:{path}" if folder else name), file, tensors, config.get("architecture")


def _load_fault(err: RuntimeError) -> str:
    """What load_state_dict found wrong, short: the tensors missing, those with no place, the first size mismatch."""
    said = []
    for line in (line.strip() for line in str(err).splitlines()[1:]):
        names = re.findall(r'"([^"]+)"', line)
        if line.startswith("Missing key(s)") and names:
            said.append(f"it lacks {len(names)} of the encoder's tensors, e.g. {names[0]!r}")
        elif line.startswith("Unexpected key(s)") and names:
            said.append(f"holds {len(names)} it has no place for, e.g. {names[0]!r}")
        elif (size := re.match(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[.*?\])\) from checkpoint, the "
                                r"shape in current model is torch.Size\((\[.*?\])\)", line)) and not any("is shaped" in s for s in said):
            said.append(f"its {size[1]} is shaped {size[2]}, not {size[3]}")
    return "; ".join(said) or str(err).strip().splitlines()[0].rstrip(".:")


def pool_tokens(features: torch.Tensor, grid: tuple[int, int], token_grid: tuple[int, int]) -> torch.Tensor:
    """(B, gh*gw, C) patch features in raster order -> (B, h*w, C), each token the mean of the patches it covers."""
    (gh, gw), (h, w) = grid, token_grid
    if (gh, gw) == (h, w):
        return features
    b, _, c = features.shape
    maps = features.transpose(1, 2).reshape(b, c, gh, gw)  # (B, gh*gw, C) -> (B, C, gh, gw)
    pooled = F.avg_pool2d(maps, (gh // h, gw // w))  # (B, C, gh, gw) -> (B, C, h, w)
    return pooled.flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, C)


def check_pooling(grid: tuple[int, int], token_grid: tuple[int, int], what: str, input_size: int) -> None:
    """Refuse a patch grid that does not cover the token grid a whole number of times per side, naming a size that fits."""
    h, w = token_grid
    if grid[0] % h or grid[1] % w:
        patch = input_size / grid[0]
        fit = int(round(patch * h)) if round(patch * h) * w == round(patch * w) * h else None
        hint = f"e.g. align.input_size={fit}" if fit else "a square token grid"
        raise ConfigError(f"{what} a {grid[0]}x{grid[1]} patch grid, which does not pool onto the model's {h}x{w} token grid (each "
                          f"side must be a whole multiple); choose an input size whose patch grid is a multiple of {h}x{w} ({hint}).")
