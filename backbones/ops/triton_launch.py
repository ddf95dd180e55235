"""Launching an autotuned Triton kernel without its autotuner on the hot path.

`triton.autotune` re-enters its Python dispatch on every call: it gathers the key arguments and every tensor's
dtype, looks the key up, runs the config's pre-hook and only then calls the JIT function. The ops here launch
3 to 4 autotuned kernels per call, on a path where the host's time per training step is a budget (issue 46: about
0.5 ms of the measured forward + backward was outside the kernels). `launch` runs the autotuner once per key, keeps
the config it picked, and from then on calls the JIT function with that config directly; the JIT's own cache
(keyed on its specialisation of every argument) still picks the compiled kernel, so a launch never reuses a
binary built for other alignments or constants.
"""

from __future__ import annotations

import triton


def launch(kernel: triton.runtime.Autotuner, key: tuple, grid, *args, **kwargs) -> triton.Config:
    """Launches autotuned `kernel` on `grid`; returns the config that ran.

    key: the caller's own tuple of everything the autotuner keys on for this launch (its `key` arguments and
    the tensors' dtypes, plus whatever its pruner reads), so that a config is reused only where the autotuner
    would have picked the same one."""
    configs, picked = kernel.__dict__.get("_picked", (None, None))
    if configs is not kernel.configs:  # first use, or the candidate list was replaced (tests do): start over
        picked = {}
        kernel._picked = (kernel.configs, picked)
    config = picked.get(key)
    if config is None:
        kernel[grid](*args, **kwargs)
        picked[key] = config = kernel.best_config
    else:
        kernel.fn.run(*args, grid=grid, warmup=False, **kwargs, **config.all_kwargs())
    return config
