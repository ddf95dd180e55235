"""Captioned video folders (`data=videos`): clips or frame folders, each with a caption, for fine-tuning Wan.

Layout, as video trainers (musubi-tuner, SimpleTuner) read it: a clip `name.mp4` (or .gif, .webm, .mov, .mkv, .avi)
beside `name.txt`, or a folder of frames `name/0001.png ...` (sorted by name) beside `name.txt`; sub-folders allowed.
A sample is the clip's first data.frames frames (every data.stride-th), centre-cropped to the aspect of data.width x
data.height and resized to it.

`check_videos(cfg)` refuses, in one sentence naming the file or key and the fix, before any work: a folder without
clips, a clip without a caption or with an empty one, an unreadable clip, a clip shorter than the frames a sample
takes, a frame count the VAE cannot encode (Wan's: 1 + 4k), latent frames fewer than the model's temporal patch, a
frame size that is not a whole number of the model's patches, a frame folder whose frames differ in size, and a
force-keep mask (masks.py) of the wrong size or mode, or beside no clip or frame. The captions and clips are then
encoded once into a cache (video_cache.py), which `VideosDataset` trains from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageSequence

from routing.errors import ConfigError
from train.data.buckets import fit_frame
from train.data.caption_cache import PIXELS, vae_folder
from train.data.captions import UNREADABLE
from train.data.captions import read_caption as read_sidecar
from train.data.images import IMAGE_EXTENSIONS
from train.data.masks import check_mask, check_orphans, check_sample_weights, check_weights, is_mask_file, mask_file, read_mask
from train.files import read_config

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi")
CLIP_EXTENSIONS = (".gif", *VIDEO_EXTENSIONS)


@dataclass(frozen=True)
class Clip:
    file: str  # path relative to the folder, posix: a clip file or a frame folder
    caption: str
    frames: int
    size: tuple[int, int]  # (width, height) in pixels
    stamp: tuple[int, int]  # (bytes, mtime in ns) of the file, or of the newest frame: a change re-encodes the clip


def frame_files(folder: Path) -> list[Path]:
    """A frame folder's frames, sorted by name; a frame's mask (`0001.mask.png`, masks.py) is not a frame."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not is_mask_file(p))


def clip_paths(root: Path) -> list[Path]:
    """Clip files and frame folders under `root` (the cache folder and hidden entries skipped), sorted."""
    found = []
    for path in sorted(root.rglob("*")):
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        if path.is_file() and path.suffix.lower() in CLIP_EXTENSIONS:
            found.append(path)
        elif path.is_dir() and frame_files(path):
            found.append(path)
    return found


def read_caption(clip: Path) -> str:
    """A clip's caption: name.txt beside a clip file, or beside its frame folder."""
    return read_sidecar(clip, clip.with_suffix(".txt") if clip.is_file() else clip.parent / f"{clip.name}.txt", "clip")


def _unreadable(clip: Path, err: BaseException) -> ConfigError:
    return ConfigError(f"clip '{clip}' is unreadable ({type(err).__name__}); replace or delete it.")


def frame_size(folder: Path) -> tuple[int, int]:
    """The one (width, height) of a frame folder's frames (headers only); refuses frames of different sizes, which
    fit_frame would each crop differently, so the clip's content would jump from frame to frame."""
    sizes = {}
    for file in frame_files(folder):
        try:
            with Image.open(file) as frame:
                sizes.setdefault(frame.size, file)
        except UNREADABLE as err:
            raise _unreadable(folder, err) from None
        if len(sizes) > 1:
            (a, first), (b, other) = sizes.items()
            raise ConfigError(f"clip '{folder}' has frames of different sizes ('{first.name}' is {a[0]}x{a[1]}, '{other.name}' is "
                              f"{b[0]}x{b[1]}); resize its frames to one size, or move the clip out of data.path.")
    return next(iter(sizes))


def probe(clip: Path) -> tuple[int, tuple[int, int]]:
    """(frame count, (width, height)) of a clip file or a frame folder, without decoding every frame."""
    if clip.is_dir():
        return len(frame_files(clip)), frame_size(clip)
    try:
        if clip.suffix.lower() == ".gif":
            with Image.open(clip) as gif:
                return gif.n_frames, gif.size
        import imageio_ffmpeg

        reader = imageio_ffmpeg.read_frames(str(clip))
        meta = next(reader)
        reader.close()
        return imageio_ffmpeg.count_frames_and_secs(str(clip))[0], tuple(meta["size"])
    except (*UNREADABLE, RuntimeError, StopIteration, IndexError) as err:
        raise _unreadable(clip, err) from None


def read_frames(clip: Path, count: int, stride: int = 1) -> list[Image.Image]:
    """The clip's frames 0, stride, 2 stride, ... (`count` of them) as RGB images."""
    wanted = set(range(0, count * stride, stride))
    try:
        if clip.is_dir():
            frames = [Image.open(f).convert("RGB") for i, f in enumerate(frame_files(clip)) if i in wanted]
        elif clip.suffix.lower() == ".gif":
            with Image.open(clip) as gif:
                frames = [f.convert("RGB") for i, f in enumerate(ImageSequence.Iterator(gif)) if i in wanted]
        else:
            import imageio_ffmpeg

            reader = imageio_ffmpeg.read_frames(str(clip))
            width, height = next(reader)["size"]
            frames = []
            for i, raw in enumerate(reader):
                if i in wanted:
                    frames.append(Image.frombytes("RGB", (width, height), raw))
                if len(frames) == count:
                    break
            reader.close()
    except (*UNREADABLE, RuntimeError) as err:
        raise _unreadable(clip, err) from None
    if len(frames) < count:
        raise ConfigError(f"clip '{clip}' gave {len(frames)} frames, fewer than the {count} it was listed with; replace or delete it.")
    return frames


def clip_array(clip: Path, frames: int, stride: int, width: int, height: int) -> np.ndarray:
    """(3, frames, height, width) float32 in [-1, 1]: the sample a clip gives."""
    images = [np.asarray(fit_frame(f, (width, height)), dtype=np.float32) for f in read_frames(clip, frames, stride)]
    return (np.stack(images).transpose(3, 0, 1, 2) / 127.5 - 1).astype(np.float32)  # (T, H, W, 3) -> (3, T, H, W)


def list_clips(folder: str | Path, frames: int, stride: int) -> list[Clip]:
    """Every clip under `folder` with its caption, frame count, size and stamp; refuses a clip too short to sample."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ConfigError(f"data.path='{root}' is not a folder; point it at a folder of clips (name.mp4 + name.txt) or frame folders.")
    paths = clip_paths(root)
    if not paths:
        raise ConfigError(f"data.path='{root}' holds no clips ({', '.join(CLIP_EXTENSIONS)}) and no folders of frames; add clips "
                          "with a .txt caption beside each (name.mp4 + name.txt, or name/0001.png ... + name.txt).")
    need = 1 + (frames - 1) * stride
    out = []
    for path in paths:
        caption = read_caption(path)
        count, size = probe(path)
        if count < need:
            raise ConfigError(f"clip '{path}' has {count} frames, but a sample takes {need} (data.frames={frames}, data.stride={stride}); "
                              "lower data.frames or data.stride, or move the clip out of data.path.")
        check_clip_masks(path, size)
        stat = max((f.stat() for f in frame_files(path)), key=lambda s: s.st_mtime_ns) if path.is_dir() else path.stat()
        out.append(Clip(path.relative_to(root).as_posix(), caption, count, size, (stat.st_size, stat.st_mtime_ns)))
    check_orphans(root, [*paths, *(f for p in paths if p.is_dir() for f in frame_files(p))])
    return out


def check_clip_masks(clip: Path, size: tuple[int, int]) -> None:
    """A clip's force-keep masks (masks.py): `name.mask.png` beside it (every frame) and, in a frame folder,
    `0001.mask.png` beside a frame (that frame); each single-channel grey at the frame size."""
    if mask_file(clip).is_file():
        check_mask(mask_file(clip), size, clip)
    for frame in frame_files(clip) if clip.is_dir() else []:
        if mask_file(frame).is_file():
            check_mask(mask_file(frame), size, frame)


def _mask_paths(clip: Path, frames: int, stride: int) -> list[Path | None]:
    """The mask file of each of a sample's frames: the frame's own, else the clip's, else None."""
    whole = mask_file(clip) if mask_file(clip).is_file() else None
    if not clip.is_dir():
        return [whole] * frames
    own = [mask_file(f) for f in frame_files(clip)[: 1 + (frames - 1) * stride : stride]]
    return [m if m.is_file() else whole for m in own]


def has_mask(clip: Path, frames: int, stride: int) -> bool:
    return any(m is not None for m in _mask_paths(clip, frames, stride))


def sample_masks(clip: Path, frames: int, stride: int) -> list[Image.Image | None] | None:
    """The masks of a sample's frames (None for a frame without one); None when none of them has a mask."""
    paths = _mask_paths(clip, frames, stride)
    return [read_mask(m) if m is not None else None for m in paths] if any(m is not None for m in paths) else None


def model_patch(cfg) -> tuple[int, int, int]:
    """The pretrained Wan transformer's (p_t, p_h, p_w), read from its config.json only."""
    from backbones.adapters import pretrained_folder

    folder = pretrained_folder("wan", cfg.finetune.pretrained, what="finetune.pretrained")
    return tuple(read_config(folder / "config.json").get("patch_size", (1, 2, 2)))


def model_channels(cfg) -> int:
    """The channels the pretrained Wan transformer denoises (its out_channels), from its config.json."""
    from backbones.adapters import pretrained_folder

    config = read_config(pretrained_folder("wan", cfg.finetune.pretrained, what="finetune.pretrained") / "config.json")
    return int(config.get("out_channels") or config.get("in_channels", 16))


def vae_factors(cfg) -> tuple[int, int, int]:
    """(temporal, spatial, channels) of the latents: the Wan VAE's (4, 8, z_dim), read from its config, or (1, 1, 3) for pixels."""
    folder = vae_folder(cfg)
    if folder is None:
        return 1, 1, 3
    config = read_config(folder / "config.json")
    temporal = config.get("scale_factor_temporal") or 2 ** sum(config.get("temperal_downsample", [False, True, True]))
    spatial = config.get("scale_factor_spatial") or 2 ** (len(config.get("dim_mult", [1, 2, 4, 4])) - 1)
    return int(temporal), int(spatial), int(config.get("z_dim", 16))


def check_videos(cfg) -> list[Clip]:
    """Every refusal of a `data=videos` run before any work: the model it needs, the sample's shape against the VAE and
    the model's patch, then the folder (list_clips)."""
    from omegaconf import OmegaConf

    d, family = cfg.data, (cfg.get("finetune") or {}).get("family")
    if family != "wan":
        raise ConfigError(f"data=videos trains a video model, but finetune.family={family}; fine-tune Wan (+experiment=finetune_wan "
                          "finetune.pretrained=weights/Wan2.1-T2V-1.3B-Diffusers).")
    if OmegaConf.is_missing(d, "path") or not d.path:
        raise ConfigError("data=videos needs data.path=<folder of clips or frame folders with a .txt caption beside each>.")
    temporal, spatial, channels = vae_factors(cfg)
    (p_t, p_h, p_w), wanted = model_patch(cfg), model_channels(cfg)
    if channels != wanted:
        source = "data.vae=pixels gives RGB frames" if d.get("vae") == PIXELS else f"the VAE gives {channels}-channel latents"
        raise ConfigError(f"{source}, but the model in finetune.pretrained='{cfg.finetune.pretrained}' denoises {wanted} channels; "
                          "encode the clips with its own pipeline's VAE (drop data.vae).")
    if (d.frames - 1) % temporal:
        raise ConfigError(f"data.frames={d.frames} is not 1 + {temporal}k, the frame counts the VAE encodes (its first latent frame holds "
                          f"one frame, each other {temporal}); use e.g. data.frames={1 + temporal * max(1, (d.frames - 1) // temporal)}.")
    latent = 1 + (d.frames - 1) // temporal
    if latent % p_t:
        raise ConfigError(f"data.frames={d.frames} gives {latent} latent frames, which the model's temporal patch {p_t} does not divide "
                          f"(a clip shorter than the patch, or not a whole number of patches); use data.frames={1 + temporal * (p_t * (latent // p_t + 1) - 1)}.")
    for key, side, p in (("height", d.height, p_h), ("width", d.width, p_w)):
        if side % (spatial * p):
            raise ConfigError(f"data.{key}={side} is not a multiple of {spatial * p} (the VAE's factor {spatial} x the model's patch {p}); "
                              f"use data.{key}={max(1, round(side / (spatial * p))) * spatial * p}.")
    check_weights(d.get("mask_loss_weight"))
    clips = list_clips(d.path, d.frames, d.stride)
    root = Path(d.path).expanduser()
    for clip in clips:
        path = root / clip.file
        frames = frame_files(path) if path.is_dir() else []
        masks = [mask_file(path)] if mask_file(path).is_file() else \
            [mask_file(f) for f in frames] if frames and all(mask_file(f).is_file() for f in frames) else []
        check_sample_weights(path, masks, d.get("mask_loss_weight"))
    return clips
