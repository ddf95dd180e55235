"""`python -m train [group=option ...] [key=value ...]`: train a diffusion model (see configs/config.yaml)."""

import sys

import hydra
from omegaconf import DictConfig

from train.cli import CONFIGS, friendly_errors, precompose


# An absolute folder: a relative one resolves as a Python package when the entry point is imported (tests).
@hydra.main(config_path=str(CONFIGS), config_name="config", version_base="1.3")
@friendly_errors
def main(cfg: DictConfig) -> None:
    from train.rundir import HydraRecord
    from train.trainer import Trainer

    # Hydra writes nothing before the job (configs/config.yaml); the trainer writes its record once checks passed.
    Trainer(cfg, record=HydraRecord.current(cfg)).fit()


def cli(argv: list[str]) -> None:
    """What `python -m train ARGS` runs (tests call it in-process)."""
    precompose("config", argv)  # a bad key, type or range: one sentence, exit 2, before any folder exists
    sys.argv = [sys.argv[0], *argv]  # Hydra reads its command line from sys.argv
    main()


if __name__ == "__main__":
    cli(sys.argv[1:])
