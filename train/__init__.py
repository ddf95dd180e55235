"""Hydra entry (`python -m train`), trainer, data, checkpoints and sub-commands (train.sample, ...)."""
