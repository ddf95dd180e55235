"""Entry-point helpers: ConfigError -> one line and exit 2, RunStopped -> one line and exit 3, Preempted -> the line
naming its checkpoint and exit 128 + the signal, a file-system
fault (OSError) -> one line naming the file, exit 3 for a full disk and 2 otherwise; no traceback. Hydra
composition errors (a wrong type, an unknown key or option) as one sentence too; argparse flags (devices,
output paths) that refuse bad values in one sentence."""

from __future__ import annotations

import argparse
import errno
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from routing import ConfigError
from train.schema import check_choices, check_config, check_overrides, config_error
from train.schema.yaml_bools import check_yaml_booleans

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class RunStopped(RuntimeError):
    """A run that cannot go on (divergence, a full disk); the message names the last good checkpoint."""


class Preempted(Exception):
    """A run stopped by SIGTERM, SIGUSR1 or SIGINT after saving its step (train/trainer/preemption.py); the message is
    the line naming the checkpoint, `code` the exit status: 128 + the signal's number (143, 138, 130), as a shell
    reports a process the signal ended, so job scripts treat it as preempted, never as finished or refused."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.code = 128 + signum


def friendly_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        except RunStopped as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(3)
        except Preempted as err:  # saved and named: a line of its own (every process raises it; rank 0 prints it)
            if os.environ.get("RANK", "0") == "0":
                print(str(err), file=sys.stderr)
            sys.exit(err.code)
        except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves first): no traceback
            if os.environ.get("RANK", "0") == "0":
                print("interrupted by Ctrl-C (SIGINT); every file written so far is whole (each is written whole or not at "
                      "all), and a training run continues from its newest checkpoint with resume=auto.", file=sys.stderr)
            sys.exit(130)
        except OSError as err:  # the file system refused a read or write that no check could foresee
            print(f"error: {file_system_error(err)}", file=sys.stderr)
            sys.exit(3 if is_disk_full(err) else 2)

    return wrapper


# What to do about a file-system fault, by errno.
_FS_FIX = {
    errno.ENOSPC: "the disk is full; free space (or choose a folder on another disk) and run the command again",
    errno.EDQUOT: "the disk quota is used up; free space and run the command again",
    errno.EACCES: "permission denied; make it writable or choose another path",
    errno.EPERM: "operation not permitted; make it writable or choose another path",
    errno.EROFS: "the disk is read-only; choose a path on a writable disk",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.EISDIR: "it is a folder; pass a file path",
    errno.ENOENT: "it does not exist; check the path",
    errno.EEXIST: "it already exists; choose another path",
}


def file_system_error(err: OSError) -> str:
    """An OSError as one sentence: the file, what happened and what to do."""
    where = f"'{err.filename}'" if err.filename else "a file"
    fix = _FS_FIX.get(err.errno) if not is_disk_full(err) else _FS_FIX[errno.ENOSPC]
    return f"could not use {where} ({err.strerror or type(err).__name__}): {fix or 'check the path and the disk'}."


def is_disk_full(err: BaseException) -> bool:
    """True for a write that failed because the disk (or the user's quota) is full."""
    return getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(err)


def precompose(config_name: str, overrides: list[str], check: Callable[[DictConfig], None] | None = None) -> DictConfig | None:
    """Compose `config_name` with the command line's overrides before Hydra does, so that a wrong type, an
    unknown key or option, or a value out of range is one sentence with exit code 2 (Hydra would print a
    multi-line report with exit code 1), and nothing, not even the run folder, is created. Returns the config.

    `check`: what else the composed config must pass (the training config's: the schema, `check_config`)."""
    if any(arg.startswith("-") for arg in overrides):
        return None  # Hydra's own flags (--help, --multirun, --cfg, ...): Hydra handles the command line
    from hydra import compose, initialize_config_dir

    training = config_name == "config"
    try:
        if training:
            check_overrides(overrides)
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
            if training:  # a YAML file's quoted "true": OmegaConf would convert it in silence
                check_yaml_booleans(config_name, overrides, cfg)
                check_choices(overrides, cfg)  # a group option the composed config no longer honours (routing=sprint)
    except ConfigError as err:
        refuse(err)
    except Exception as err:  # Hydra and OmegaConf raise many types; each becomes one sentence
        refuse(config_error(err, _composed_without(err, overrides)) if training
               else _plain_config_error(config_name, err))
    try:
        (check or (check_config if training else lambda _: None))(cfg)
        if training and check is None and cfg.data.name == "captions":  # a missing caption or an unreadable image, before any work
            from train.data.captions import check_captions

            check_captions(cfg)
        if training and check is None and cfg.data.name == "videos":  # likewise a clip's, and the sample's shape
            from train.data.videos import check_videos

            check_videos(cfg)
    except ConfigError as err:
        refuse(err)
    if training:
        note_repeated_keys(overrides)  # valid, so only once every check passed: a refusal stays the one line
    return cfg


def _composed_without(err: BaseException, overrides: list[str]) -> DictConfig | None:
    """The training config composed without the override of the key `err` is about (None when that fails too): what
    the other overrides chose, so that another option's key (data.frames under data=latents) names the option."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cause = err
    while not isinstance(cause, OmegaConfBaseException) and cause.__cause__ is not None:
        cause = cause.__cause__
    path = str(getattr(cause, "full_key", "") or "")
    if not path:
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        rest = [o.input_line for o in parsed if o.key_or_group != path]
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            return compose(config_name="config", overrides=rest)
    except Exception:  # noqa: BLE001 -- the hint is optional; the refusal stands without it
        return None


def note_repeated_keys(overrides: list[str]) -> None:
    """Print one note per key (or group) given more than once on the command line: Hydra takes the last one, which is
    valid and what scripts that append to a base list of overrides rely on, but a hand-edited command may not mean it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 -- a malformed override: composing reports it in one sentence
        return
    given: dict[str, list[str]] = {}
    for override in parsed:
        given.setdefault(override.key_or_group, []).append(override.input_line)
    for key, lines in given.items():
        if len(lines) > 1 and os.environ.get("RANK", "0") == "0":
            times = "twice" if len(lines) == 2 else f"{len(lines)} times"
            # stdout, with the run's other notes: stderr stays the one line of a refusal
            print(f"note: {key} is given {times} on the command line ({', '.join(lines)}); the last one, {lines[-1]}, is used.")


def _plain_config_error(config_name: str, err: BaseException) -> ConfigError:
    """A composition error of a config without a typed schema (bench.yaml): an unknown key names the keys there are."""
    cause = err
    while not isinstance(cause, OmegaConfBaseException) and cause.__cause__ is not None:
        cause = cause.__cause__
    path = str(getattr(cause, "full_key", "") or "")
    if not (isinstance(cause, OmegaConfBaseException) and path and "not in struct" in str(cause)):
        return config_error(err)
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        base = compose(config_name=config_name)
    parent = OmegaConf.select(base, path.rsplit(".", 1)[0]) if "." in path else base
    known = f"; the keys there are {', '.join(str(k) for k in parent)}" if isinstance(parent, DictConfig) else ""
    return ConfigError(f"{path} is not a key of configs/{config_name}.yaml{known}.")


def refuse(err: BaseException) -> None:
    """Exit 2 with `err` as one line. Under a launcher (accelerate launch, torchrun) every process composes the same
    config and refuses alike before any collective, so only rank 0 prints the sentence; the others exit quietly with
    the same code (docs/training.md: why the launcher still prints its own traceback)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


# Flags of the argparse commands.


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one sentence (no usage block) with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        refuse(ConfigError(f"{self.prog}: {message.rstrip('.')}; see {self.prog} --help."))


def bounded(kind: type, low: float | None = None, high: float | None = None, *, example: str = ""):
    """An argparse type: `kind` (int or float) in [low, high], refusing other values in one sentence."""
    name = {int: "an integer", float: "a number"}[kind]

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}{f' (e.g. {example})' if example else ''}") from None
        if value != value or (low is not None and value < low) or (high is not None and value > high):
            rng = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{text} is out of range; it must be {rng}{f' (e.g. {example})' if example else ''}")
        return value

    parse.__name__ = kind.__name__
    return parse


def existing(what: str = "path"):
    """An argparse type: a path that exists."""

    def parse(text: str) -> str:
        if not Path(text).expanduser().exists():
            raise argparse.ArgumentTypeError(f"{what} {text!r} does not exist")
        return text

    parse.__name__ = what
    return parse


def _writable_folder(folder: Path, text: str) -> None:
    """Refuse (ArgumentTypeError) an output folder under a file, or whose nearest existing part we cannot write into."""
    existing_part = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    if not existing_part.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it lies under {str(existing_part)!r}, which is a file")
    if not os.access(existing_part, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(existing_part)!r} is not writable")


def writable_file(text: str) -> Path:
    """An argparse type: an output file whose folder exists or can be created, and that is not a folder."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; pass a file path")
    _writable_folder(path.parent, text)
    return path


def output_folder(text: str) -> Path:
    """An argparse type: an output folder that exists or can be created (not a file, not under one)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder; pass a folder path")
    _writable_folder(path, text)
    return path


def check_device(text: str, name: str) -> str:
    """`text` if it names a device this machine has (cpu, cuda, cuda:N, mps), else one sentence naming `name`."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{name}={text!r} is not a device; use cpu or cuda (cuda:N for GPU N).") from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= gpus:
        raise ConfigError(f"{name}={text} but this machine has {gpus or 'no'} visible CUDA GPU{'s' if gpus != 1 else ''}; "
                          f"use {name}=cpu{f' or cuda:0..cuda:{gpus - 1}' if gpus else ''}.")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{name}=mps but this machine has no Apple GPU; use {name}=cpu.")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{name}={text!r} is not supported; use cpu or cuda (cuda:N for GPU N).")
    return text


def device(text: str) -> str:
    """An argparse type: a device this machine has."""
    try:
        return check_device(text, "--device")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).split("=", 1)[-1].rstrip(".")) from None


def check_scan_switches(parser: argparse.ArgumentParser, cuda: bool) -> None:
    """TREAD_SCAN_BACKEND and TREAD_SCAN_CHUNK (backbones/ops/selective_scan_env.py) for a command that may run the
    scan: a bad value is the parser's one sentence and exit 2, before any work; a value that does nothing on this
    machine is one line on stderr."""
    from backbones.ops.selective_scan_env import check_scan_environment

    try:
        notes = check_scan_environment(cuda)
    except ConfigError as err:
        parser.error(str(err))
    for note in notes:
        print(note, file=sys.stderr)


def check_presets(parser: argparse.ArgumentParser, family: str, presets: list[str], flag: str = "--presets") -> None:
    """Refuse, in one sentence, a preset that backbone `family` does not define (before any model is built)."""
    from backbones import family_module

    known = list(family_module(family).PRESETS)
    for preset in presets:
        if preset not in known:
            parser.error(f"{flag} {preset}: {family} has no such preset; choose from {', '.join(known)}")


def check_tokens(parser: argparse.ArgumentParser, side: int, patch: int, side_flag: str = "--input-size",
                 patch_flag: str = "--patch") -> None:
    """Refuse a latent side that patches of `patch` do not tile."""
    if side % patch:
        parser.error(f"{side_flag} {side} is not a multiple of {patch_flag} {patch}; patches must tile the latent "
                     f"(e.g. {side_flag} {max(patch, side - side % patch)})")


def add_sampling_rule_flags(parser: argparse.ArgumentParser, route_ratio: float = 0.0, rg_scale: float = 1.0,
                            rg_gamma2: float = 0.5) -> None:
    """The flags train.sample and train.fid share: routed inference, routing guidance, DiffMoE capacity."""
    parser.add_argument("--route-ratio", type=bounded(float, 0, 0.99, example="--route-ratio 0.5"), default=route_ratio,
                        help="routed inference: force routing at this selection ratio over the trained routes (0 = off)")
    parser.add_argument("--rg-scale", type=bounded(float, 0, 100, example="--rg-scale 2"), default=rg_scale,
                        help="routing guidance scale w (1 = off)")
    parser.add_argument("--rg-gamma1", type=bounded(float, 0, 0.99, example="--rg-gamma1 0.25"), default=None,
                        help="routing guidance: ratio of the strong branch (fewer tokens bypass; default unrouted)")
    parser.add_argument("--rg-gamma2", type=bounded(float, 0, 0.99, example="--rg-gamma2 0.5"), default=rg_gamma2,
                        help="routing guidance: ratio of the weak branch")
    parser.add_argument("--rg-uncond", action="store_true", help="both routing-guidance branches unconditional (the released sample_tread)")
    parser.add_argument("--pdg-scale", type=bounded(float, 0, 100, example="--pdg-scale 3"), default=1.0,
                        help="SPRINT's path-drop guidance w (1 = off): the weak branch has the null label and skips the sparse "
                             "middle; in place of CFG, for routing=sprint models")
    parser.add_argument("--moe-threshold", type=bounded(float, 0, 1, example="--moe-threshold 0.5"),
                        help="DiffMoE: one capacity-predictor threshold for every expert")
    parser.add_argument("--moe-target", type=bounded(float, 0.01, example="--moe-target 1.0"),
                        help="DiffMoE: average activated experts per token")


def check_sampling_rule_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, in one sentence, flag combinations that the sampling rules cannot honour."""
    if args.rg_scale != 1 and args.rg_gamma1 is not None and args.rg_gamma1 > args.rg_gamma2 and not getattr(args, "rg_bad", None):
        parser.error(f"--rg-gamma1 {args.rg_gamma1} must not exceed --rg-gamma2 {args.rg_gamma2}: the strong branch processes "
                     "more tokens (e.g. --rg-gamma1 0.25 --rg-gamma2 0.75)")
    if args.moe_threshold is not None and args.moe_target is not None:
        parser.error("give --moe-threshold or --moe-target, not both")
    if args.pdg_scale != 1 and args.guidance != 1:
        parser.error(f"--pdg-scale {args.pdg_scale:g} takes the place of CFG's unconditional branch; drop --guidance "
                     f"{args.guidance:g} (or --pdg-scale)")
    if args.pdg_scale != 1 and args.rg_scale != 1:
        parser.error("give --pdg-scale or --rg-scale, not both: each is a guidance rule with its own weak branch")
