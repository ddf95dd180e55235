"""`python -m train.bench [bench=quick|smoke] [key=value ...]`: the cross-backbone table (docs/benchmarks.md)."""

import sys

import hydra
from omegaconf import DictConfig

from train.cli import friendly_errors, precompose


@hydra.main(config_path="../../configs", config_name="bench", version_base="1.3")
@friendly_errors
def main(bench: DictConfig) -> None:
    from train.bench.runner import run

    run(bench)


if __name__ == "__main__":
    precompose("bench", sys.argv[1:], check=False)  # a bad key or option: one sentence, exit 2
    main()
