"""`python -m train [group=option ...] [key=value ...]`: train a diffusion model (see configs/config.yaml)."""

import sys

import hydra
from omegaconf import DictConfig

from train.cli import CONFIGS, friendly_errors, precompose, refuse


# An absolute folder: a relative one resolves as a Python package when the entry point is imported (tests).
@hydra.main(config_path=str(CONFIGS), config_name="config", version_base="1.3")
@friendly_errors
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from train.rundir import HydraRecord
    from train.schema.yaml_bools import check_yaml_booleans
    from train.trainer import Trainer

    # Hydra's own flags (--config-dir, -cn, ...) skip precompose: a YAML file's quoted "true" is caught here, as Hydra
    # loaded it (the search path and overrides of this job).
    job = HydraConfig.get()
    check_yaml_booleans(job.job.config_name, list(job.overrides.task), cfg)
    refuse_steps_behind(cfg)
    check_environment()

    # Hydra writes nothing before the job (configs/config.yaml); the trainer writes its record once checks passed.
    Trainer(cfg, record=HydraRecord.current(cfg)).fit()


def check_environment() -> None:
    """The selective scan's environment switches, checked before anything is built (backbones/ops/selective_scan_env.py):
    a bad value is refused in one sentence, one that does nothing on this machine is named in one line."""
    import os

    from backbones.ops.selective_scan_env import check_scan_environment

    for note in check_scan_environment():
        if os.environ.get("RANK", "0") == "0":
            print(note, file=sys.stderr)


def refuse_steps_behind(cfg: DictConfig) -> None:
    """Refuse to resume a checkpoint that is already past trainer.max_steps (in the job, before the trainer writes).

    The loop would not run a step, so the command would end in silence while a script reads exit code 0 as "trained
    to max_steps"; it cannot honour the number (steps are never undone), so it is refused with exit code 2 and the
    two ways on. A checkpoint exactly at max_steps is a finished run started again (resume=auto in a job script):
    that stays a quiet no-op. A damaged checkpoint is left to the trainer, which names what is wrong with it."""
    from pathlib import Path

    from routing import ConfigError
    from train.checkpoint import latest_checkpoint
    from train.files import read_state

    resume = cfg.get("resume")
    if not resume:
        return
    try:
        root = Path(str(cfg.run_dir)).expanduser() / "checkpoints"
        path = latest_checkpoint(root) if resume in (True, "auto", "latest") else Path(str(resume)).expanduser()
        step = read_state(path).step if path is not None and (path / "state.json").is_file() else None
    except Exception:  # noqa: BLE001 -- the trainer refuses a damaged checkpoint in its own sentence
        return
    if step is not None and step > cfg.trainer.max_steps:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps} but checkpoint '{path}' is already at step {step}, past it; "
                          f"raise trainer.max_steps above {step} to train on, or sample that checkpoint with "
                          f"`python -m train.sample {path}`.")


def cli(argv: list[str]) -> None:
    """What `python -m train ARGS` runs (tests call it in-process)."""
    import os

    from routing import ConfigError
    from train.rundir import resumed_overrides

    try:
        argv, kept, record, dropped = resumed_overrides(argv)  # resume: the run's own settings, then the command's
    except ConfigError as err:  # a damaged .hydra/overrides.yaml
        refuse(err)
    if (kept or dropped) and os.environ.get("RANK", "0") == "0":
        print(f"resume: the run's own settings from {record}: {' '.join(kept) or 'none'}"
              f"{''.join(f'; {note}' for note in dropped)}")
    precompose("config", argv)  # a bad key, type or range: one sentence, exit 2, before any folder exists
    sys.argv = [sys.argv[0], *argv]  # Hydra reads its command line from sys.argv
    main()


if __name__ == "__main__":
    cli(sys.argv[1:])
