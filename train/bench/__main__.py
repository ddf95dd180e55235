"""`python -m train.bench [bench=quick|smoke] [key=value ...]`: the cross-backbone table (docs/benchmarks.md)."""

import os
import sys

# Pin PyTorch's CPU kernels to AVX2 before torch loads: the scoring classifier is retrained in every clone, and with
# AVX-512 kernels the same seed gives other weights (87.20% held out instead of the committed cells' 87.24%), so
# cells from different CPUs would be scored differently. An explicit setting in the environment wins.
for _var, _isa in (("ATEN_CPU_CAPABILITY", "avx2"), ("DNNL_MAX_CPU_ISA", "AVX2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2")):
    os.environ.setdefault(_var, _isa)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from routing import ConfigError
from train.cli import CONFIGS, check_device, friendly_errors, precompose


def check_settings(bench: DictConfig) -> None:
    """The bench's own keys that its cells' training configs do not check, before any output folder exists."""
    batch = bench.train.batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"train.batch_size={batch!r} must be a positive integer (e.g. train.batch_size=32).")
    check_device(str(bench.device), "device")


# An absolute folder: a relative one resolves as a Python package when the entry point is imported (tests).
@hydra.main(config_path=str(CONFIGS), config_name="bench", version_base="1.3")
@friendly_errors
def main(bench: DictConfig) -> None:
    from train.bench.runner import run
    from train.rundir import HydraRecord

    # Hydra writes nothing before the job (configs/bench.yaml); the bench writes its record once its checks passed.
    run(bench, record=HydraRecord.current(bench))


def cli(argv: list[str]) -> None:
    """What `python -m train.bench ARGS` runs (tests call it in-process)."""
    precompose("bench", argv, check=check_settings)  # a bad key, option or value: one sentence, exit 2
    sys.argv = [sys.argv[0], *argv]  # Hydra reads its command line from sys.argv
    main()


if __name__ == "__main__":
    cli(sys.argv[1:])
