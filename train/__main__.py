"""`python -m train [group=option ...] [key=value ...]`: train a diffusion model (see configs/config.yaml)."""

import hydra
from omegaconf import DictConfig

from train.cli import friendly_errors


@hydra.main(config_path="../configs", config_name="config", version_base="1.3")
@friendly_errors
def main(cfg: DictConfig) -> None:
    from train.trainer import Trainer

    Trainer(cfg).fit()


if __name__ == "__main__":
    main()
