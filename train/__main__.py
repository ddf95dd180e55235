"""`python -m train [group=option ...] [key=value ...]`: train a diffusion model (see configs/config.yaml)."""

import sys

import hydra
from omegaconf import DictConfig

from train.cli import friendly_errors, precompose


@hydra.main(config_path="../configs", config_name="config", version_base="1.3")
@friendly_errors
def main(cfg: DictConfig) -> None:
    from train.trainer import Trainer

    Trainer(cfg).fit()


if __name__ == "__main__":
    precompose("config", sys.argv[1:])  # a bad key, type or range: one sentence, exit 2, before any folder exists
    main()
