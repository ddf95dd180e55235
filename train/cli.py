"""Entry-point helpers: ConfigError -> one line and exit 2, RunStopped -> one line and exit 3, no traceback;
Hydra composition errors (a wrong type, an unknown key or option) as one sentence too; argparse flags that
refuse bad values in one sentence."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from routing import ConfigError
from train.schema import check_config, config_error

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class RunStopped(RuntimeError):
    """A run that cannot go on (divergence, a full disk); the message names the last good checkpoint."""


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

    return wrapper


def precompose(config_name: str, overrides: list[str], check: bool = True) -> None:
    """Compose `config_name` with the command line's overrides before Hydra does, so that a wrong type, an
    unknown key or option, or a value out of range is one sentence with exit code 2 (Hydra would print a
    multi-line report with exit code 1), and nothing, not even the run folder, is created."""
    if any(arg.startswith("-") for arg in overrides):
        return  # Hydra's own flags (--help, --multirun, --cfg, ...): Hydra handles the command line
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
    except ConfigError as err:
        _refuse(err)
    except Exception as err:  # Hydra and OmegaConf raise many types; each becomes one sentence
        _refuse(config_error(err))
    if check:
        try:
            check_config(cfg)
            if cfg.data.name == "captions":  # a missing caption or an unreadable image, before Hydra makes the run folder
                from train.data.captions import check_captions

                check_captions(cfg)
        except ConfigError as err:
            _refuse(err)


def _refuse(err: BaseException) -> None:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


# Flags of the argparse commands.


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one sentence (no usage block) with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _refuse(ConfigError(f"{self.prog}: {message.rstrip('.')}; see {self.prog} --help."))


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


def writable_file(text: str) -> Path:
    """An argparse type: an output file whose folder exists or can be created, and that is not a folder."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; pass a file path")
    parent = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)
    if parent is None or not parent.is_dir() or not _can_write(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r} (its folder is not writable)")
    return path


def _can_write(folder: Path) -> bool:
    import os

    return os.access(folder, os.W_OK | os.X_OK)


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
