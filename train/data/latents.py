"""Cached VAE latents as a training dataset (`data=latents`), read from memory-mapped shards.

The folder layout is written by `python -m train.cache_latents` and described in docs/latents.md:
`shard-XXXXX.safetensors` files with the unscaled posterior `mean`, `std` (n, C, h, w) and
`labels` (n,), plus `meta.json` and `stats.json`. Each `get` draws z = mean + std * eps from the
VAE posterior (fresh eps per call, from the caller's generator), scales it by the VAE's scaling
factor and, with `normalize: standardize`, maps every channel to mean 0 and std sigma_data, which
is the data scale the EDM preconditioning assumes (SD-VAE latents scaled by 0.18215 have a std
near 1, not 0.5). A fine-tune instead trains in its pretrained model's latent space, the VAE's own
(z - shift_factor) * scaling_factor (`normalize: scale`), which `normalize: auto` (the default) picks
whenever finetune.family is set; `check_latent_space` refuses a cache that does not match the model.

Shards are never loaded whole: each is opened as numpy memmaps on first use (the safetensors
header gives every tensor's dtype, shape and byte offset), so random access costs only the rows
read and memory stays flat however large the data set is.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backbones.adapters.pretrained import dtype_kwarg
from routing.errors import ConfigError
from train.data.latents_space import resolve_normalize
from train.files import read_config, read_meta, read_stats

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
NORMALIZE_MODES = ("standardize", "scale")

# The safetensors dtypes a shard may use, as numpy dtypes (little-endian by the format's spec).
_SAFETENSORS_DTYPES = {"F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "I64": np.dtype("<i8"), "U8": np.dtype("u1")}


def shard_name(index: int) -> str:
    """File name of shard `index` inside a latents folder."""
    return f"shard-{index:05d}.safetensors"


def load_vae(vae: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Load a diffusers AutoencoderKL from a local folder or a hub id, with one clear error offline."""
    from diffusers import AutoencoderKL

    folder = local_vae(vae)
    if folder is not None:
        vae_config(folder)  # another model's folder (a transformer's, a pipeline's) would fail deep inside diffusers
    try:
        model = AutoencoderKL.from_pretrained(str(folder) if folder is not None else vae, **dtype_kwarg(dtype))
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"Could not load the VAE {vae!r} ({type(error).__name__}); without network, run "
            f"`huggingface-cli download {DEFAULT_VAE} --local-dir /path/to/sd-vae-ft-ema` on a machine that has it, "
            f"copy the folder here and pass its path (cache_latents: --vae /path/to/sd-vae-ft-ema; training: "
            f"data.vae=/path/to/sd-vae-ft-ema)."
        ) from error
    return model.to(device).eval().requires_grad_(False)


def local_vae(vae: str) -> Path | None:
    """The folder `vae` names, or None for a hub id; a path-like string that is no folder is refused (a typo, not a
    hub id: said without touching the network)."""
    folder = Path(vae).expanduser()
    if folder.is_dir():
        return folder
    if os.path.isabs(vae) or vae.startswith((".", "~")) or vae.count("/") != 1:
        raise ConfigError(
            f"VAE folder {vae!r} does not exist: pass a folder holding config.json and the weights "
            f"(e.g. from `huggingface-cli download {DEFAULT_VAE} --local-dir /path/to/sd-vae-ft-ema`)."
        )
    return None


# The class load_vae builds: the image VAE of SD, SDXL, SD3 and Flux. Its video kin (AutoencoderKLWan, ...) take
# other configs and weights, so a folder of theirs is refused as any other model's is.
VAE_CLASS = "AutoencoderKL"


def vae_config(folder: Path) -> dict:
    """config.json of a local VAE folder; a folder of another model (a pipeline, its transformer) is refused in one
    sentence that names the fix: a pipeline's vae/ subfolder, when there is one."""
    inner = folder / "vae"
    fix = (f"pass its VAE subfolder, --vae {inner} (data.vae={inner} in training)" if (inner / "config.json").is_file()
           else f"pass a diffusers {VAE_CLASS} folder (e.g. from `huggingface-cli download {DEFAULT_VAE} --local-dir "
                "/path/to/sd-vae-ft-ema`)")
    if not (folder / "config.json").is_file():
        pipeline = (folder / "model_index.json").is_file()
        what = "a diffusers pipeline (model_index.json)" if pipeline else "no config.json"
        raise ConfigError(f"VAE folder '{folder}' holds {what}, not a VAE; {fix}.")
    config = read_config(folder / "config.json")
    name = config.get("_class_name")
    if name != VAE_CLASS and not (name is None and {"latent_channels", "block_out_channels"} <= config.keys()):
        raise ConfigError(f"VAE folder '{folder}' holds a {name or 'model of unknown class'}, not a diffusers "
                          f"{VAE_CLASS}; {fix}.")
    return config


def spatial_factor(config) -> int:
    """Image pixels per latent pixel of an AutoencoderKL: each block after the first halves the resolution."""
    return 2 ** (len(config["block_out_channels"]) - 1)


def vae_factor(vae: str) -> int:
    """Image pixels per latent pixel of `vae`: from a local folder's config.json, or a hub id's in the local cache;
    8, every released AutoencoderKL's, for a hub id not downloaded yet."""
    folder = local_vae(vae)
    if folder is not None:
        config = vae_config(folder)
    else:
        from diffusers import AutoencoderKL

        try:
            config = AutoencoderKL.load_config(vae, local_files_only=True)
        except (OSError, ValueError):
            return 8
    return spatial_factor(config) if config.get("block_out_channels") else 8


def read_shard_header(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """Parse a safetensors header: (tensor entries, byte offset of the data block).

    Raises ValueError when the file is truncated or not a safetensors file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError("file shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise ValueError("header length points past the end of the file")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if data_start + end > size:
            raise ValueError(f"tensor {name!r} ends past the end of the file (truncated shard)")
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {entry['dtype']}")
        expected = int(np.prod(entry["shape"], dtype=np.int64)) * _SAFETENSORS_DTYPES[entry["dtype"]].itemsize
        if end - begin != expected:
            raise ValueError(f"tensor {name!r} byte size does not match its shape")
    return header, data_start


def _memmap_shard(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only numpy memmap."""
    header, data_start = read_shard_header(path)
    arrays = {}
    for name, entry in header.items():
        begin, _ = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if 0 in shape:
            arrays[name] = np.empty(shape, dtype=_SAFETENSORS_DTYPES[entry["dtype"]])
        else:
            arrays[name] = np.memmap(
                path, dtype=_SAFETENSORS_DTYPES[entry["dtype"]], mode="r", offset=data_start + begin, shape=shape
            )
    return arrays


def _data_error(path: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"data.path={str(path)!r}: {problem}; point data.path at a folder written by `python -m train.cache_latents` "
        f"(re-running that command with the same --out resumes it and rewrites missing shards)."
    )


class LatentDataset:
    """Random-access dataset over cached VAE posteriors (see module docstring)."""

    def __init__(self, path: str | os.PathLike, normalize: str, sigma_data: float, vae: str | None = None):
        self.path = Path(path)
        if normalize not in NORMALIZE_MODES:
            raise ConfigError(f"data.normalize={normalize!r} is not one of {NORMALIZE_MODES}.")
        if not self.path.is_dir():
            raise _data_error(self.path, "not a folder")
        # meta.json and stats.json are checked once, here (train/files/latents.py), and trusted after.
        try:
            meta = read_meta(self.path)
            stats = read_stats(self.path, meta.latent_shape[0])
        except ConfigError as err:
            raise ConfigError(f"data.path={str(self.path)!r}: {err}") from None
        if not meta.complete:
            raise _data_error(self.path, "caching has not finished (meta.json says complete=false)")
        self.meta = meta
        self.num_classes: int = meta.num_classes
        self.class_names: list[str] = list(meta.class_names)
        self.shape: tuple[int, int, int] = tuple(meta.latent_shape)
        self.scaling_factor = meta.scaling_factor
        self.shift_factor = meta.shift_factor
        self.vae_path: str | None = vae or meta.vae
        self.normalize = normalize
        self.sigma_data = float(sigma_data)
        # What align=repa reads beside each latent (train.cache_latents --align-images / --align-encoder), else {}.
        self.align = dict(meta.align or {})

        # Check every shard's header now, so a missing or truncated shard fails at startup, not mid-run.
        self._files = [self.path / shard.file for shard in meta.entries]
        counts = [shard.count for shard in meta.entries]
        for file, count in zip(self._files, counts):
            self._check_shard(file, count)
        self._starts = np.cumsum([0] + counts[:-1])
        self._length = int(sum(counts))
        if self._length == 0:
            raise _data_error(self.path, "the shards hold no latents")

        # Model-space transform x = a * z + b per channel: SD scaling, then optional standardisation.
        channel_mean = torch.tensor(stats.mean, dtype=torch.float32)
        channel_std = torch.tensor(stats.std, dtype=torch.float32)
        if normalize == "standardize":
            a = self.scaling_factor * self.sigma_data / channel_std
            b = -channel_mean * self.sigma_data / channel_std
        else:
            # The VAE's own convention, (z - shift_factor) * scaling_factor: what a pretrained transformer was trained on.
            a = torch.full_like(channel_mean, self.scaling_factor)
            b = torch.full_like(channel_mean, -self.scaling_factor * self.shift_factor)
        self._a, self._b = a.view(1, -1, 1, 1), b.view(1, -1, 1, 1)  # (C,) -> (1, C, 1, 1)

        self._shards: dict[int, dict[str, np.ndarray]] = {}
        self._vae = None
        # Labels are small (8 bytes a sample): check them all now, so a bad one fails at start-up.
        for index, file in enumerate(self._files):
            labels = self._shard(index)["labels"]
            if labels.size and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise _data_error(self.path, f"shard {file.name} has labels in [{labels.min()}, {labels.max()}] outside the "
                                             f"{self.num_classes} classes of meta.json")

    def _check_shard(self, file: Path, count: int) -> None:
        if not file.is_file():
            raise _data_error(self.path, f"shard {file.name} is missing")
        try:
            header, _ = read_shard_header(file)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise _data_error(self.path, f"shard {file.name} is corrupt ({error}); delete it") from error
        expected = {"mean": [count, *self.shape], "std": [count, *self.shape], "labels": [count]}
        kinds = {"mean": ("F16", "F32"), "std": ("F16", "F32"), "labels": ("I64",)}
        if "images" in self.align:
            expected["align_images"], kinds["align_images"] = [count, 3, self.align["images"], self.align["images"]], ("U8",)
        if "features" in self.align:
            how = self.align["features"]
            expected["align_features"] = [count, how["grid"][0] * how["grid"][1], how["dim"]]
            kinds["align_features"] = ("F16",)
        for name, shape in expected.items():
            if name not in header or list(header[name]["shape"]) != shape:
                raise _data_error(self.path, f"shard {file.name} is corrupt (tensor {name!r} is not {shape}); delete it")
        # Labels must be integers (float labels would be truncated), latents floats.
        for name, allowed in kinds.items():
            if header[name]["dtype"] not in allowed:
                raise _data_error(self.path, f"shard {file.name} stores {name!r} as {header[name]['dtype']}, not "
                                             f"{' or '.join(allowed)}; re-encode it")

    def __len__(self) -> int:
        return self._length

    def __getstate__(self) -> dict:
        # Memmaps and the VAE are reopened lazily in each worker process instead of being pickled.
        state = self.__dict__.copy()
        state["_shards"], state["_vae"] = {}, None
        return state

    def _shard(self, index: int) -> dict[str, np.ndarray]:
        if index not in self._shards:
            self._shards[index] = _memmap_shard(self._files[index])
        return self._shards[index]

    def get(self, indices: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents x (n, C, h, w) float32 in model space and labels (n,) int64 for global indices (n,)."""
        flat, shard_ids, local = self._locate(indices)

        # Gather posterior rows shard by shard, in sorted order so memmap reads go forward.
        mean = np.empty((flat.size, *self.shape), dtype=np.float32)
        std = np.empty_like(mean)
        labels = np.empty(flat.size, dtype=np.int64)
        for shard_id in np.unique(shard_ids):
            rows = np.nonzero(shard_ids == shard_id)[0]
            rows = rows[np.argsort(local[rows])]
            arrays = self._shard(int(shard_id))
            mean[rows] = arrays["mean"][local[rows]]
            std[rows] = arrays["std"][local[rows]]
            labels[rows] = arrays["labels"][local[rows]]

        if not (np.isfinite(mean).all() and np.isfinite(std).all()):
            shards = sorted({self._files[int(i)].name for i in np.unique(shard_ids)})
            raise _data_error(self.path, f"shards {shards} hold NaN or inf latents (re-encode them)")
        # Sample the posterior z = mean + std * eps, then map to model space.
        device = generator.device
        eps = torch.randn(mean.shape, generator=generator, device=device)
        z = torch.from_numpy(mean).to(device) + torch.from_numpy(std).to(device) * eps
        return self.to_model_space(z), torch.from_numpy(labels).to(device)

    def _locate(self, indices: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global indices (n,) -> (them as int64, their shard ids, their rows within those shards)."""
        flat = indices.detach().cpu().numpy().astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self._length):
            raise IndexError(f"latent index out of range [0, {self._length})")
        shard_ids = np.searchsorted(self._starts, flat, side="right") - 1
        return flat, shard_ids, flat - self._starts[shard_ids]

    def align_inputs(self, indices: torch.Tensor, kind: str) -> torch.Tensor:
        """What align=repa reads for global indices (n,): kind "images", (n, 3, S, S) float32 in [-1, 1]; kind
        "features", (n, gh*gw, C) float32 on the encoder's patch grid."""
        _, shard_ids, local = self._locate(indices)
        rows = [self._shard(int(k))[f"align_{kind}"][int(i)] for k, i in zip(shard_ids, local)]
        out = torch.from_numpy(np.stack(rows).astype(np.float32))
        return out / 127.5 - 1 if kind == "images" else out

    def to_model_space(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled VAE latents (n, C, h, w) -> model space."""
        return z * self._a.to(z.device) + self._b.to(z.device)

    def from_model_space(self, x: torch.Tensor) -> torch.Tensor:
        """Model space (n, C, h, w) -> unscaled VAE latents, ready for the decoder."""
        return (x.float() - self._b.to(x.device)) / self._a.to(x.device)

    @torch.no_grad()
    def to_images(self, x: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
        """Decode model-space latents (n, C, h, w) to RGB images (n, 3, H, W) in [0, 1]."""
        if self._vae is None:
            self._vae = load_vae(self.vae_path, device=x.device)
        vae = self._vae.to(x.device)
        z = self.from_model_space(x)
        images = [vae.decode(chunk).sample for chunk in z.split(batch_size)]
        return ((torch.cat(images).float() + 1) / 2).clamp(0, 1)


def check_vae(cfg_data: Any) -> None:
    """Refuse a VAE folder that does not exist before training starts (data.vae, else the one in meta.json)."""
    vae = _cfg_value(cfg_data, "vae")
    key = "data.vae"
    if vae in (None, ""):
        folder = Path(str(_cfg_value(cfg_data, "path", ""))).expanduser()
        try:
            vae, key = read_meta(folder).vae, f"the vae in {folder / 'meta.json'}"
        except ConfigError:
            return  # the dataset itself refuses a damaged folder, naming data.path
    if not vae:
        raise ConfigError(f"{key} names no VAE, so no preview grid could be decoded; pass data.vae=/path/to/sd-vae-ft-ema "
                          "or trainer.sample_every=0.")
    vae = str(vae)
    looks_local = os.path.isabs(vae) or vae.startswith((".", "~")) or vae.count("/") != 1
    if looks_local and not Path(vae).expanduser().is_dir():
        raise ConfigError(f"{key}={vae!r} is not a folder, so no preview grid could be decoded; pass data.vae=/path/to/sd-vae-ft-ema "
                          "(a folder with config.json and the weights) or trainer.sample_every=0.")


def _cfg_value(cfg: Any, key: str, default: Any = None) -> Any:
    """Read key from a DictConfig or dict; a missing ('???') value reads as the default."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        if key not in cfg or OmegaConf.is_missing(cfg, key):
            return default
        return cfg[key]
    return cfg.get(key, default)


def build(cfg_data: Any, sigma_data: float) -> LatentDataset:
    """Dataset for `data=latents` (configs/data/latents.yaml); called lazily by the data registry."""
    path = _cfg_value(cfg_data, "path")
    if path in (None, ""):
        raise ConfigError(
            "data.path is not set: pass data.path=/path/to/latents, a folder written by `python -m train.cache_latents`."
        )
    return LatentDataset(
        path=Path(str(path)).expanduser(),
        normalize=resolve_normalize(cfg_data),
        sigma_data=sigma_data,
        vae=_cfg_value(cfg_data, "vae"),
    )
