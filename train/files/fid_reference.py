"""An FID reference: an .npz with the Inception features' mean `mu` (d,) and covariance `sigma` (d, d) (ADM's layout).

Checked before any sample is generated: a reference of the wrong size, or with NaN or inf, would otherwise
surface only at the end of hours of sampling, or as `FID nan`.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import numpy as np

from train.files.typed import damaged

FIX = ("pass an .npz with mu (d,) and sigma (d, d) of Inception pool3 features (d = {dims}), e.g. one written by "
       "`python -m train.fid --images DIR --save-stats ref.npz`")


def read_reference(path: str | os.PathLike, dims: int) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) in float64 from the .npz at `path`, for features of `dims` dimensions."""
    path, fix = Path(path).expanduser(), FIX.format(dims=dims)
    if not path.is_file():
        raise damaged(path, "is not a file" if path.exists() else "does not exist", fix)
    try:
        with np.load(path) as npz:  # a single .npy array has no `with` and lands in the except below
            arrays = {name: npz[name] for name in ("mu", "sigma") if name in npz.files}
            names = sorted(npz.files)
    except (OSError, ValueError, EOFError, AttributeError, TypeError, zipfile.BadZipFile, pickle.UnpicklingError) as err:
        raise damaged(path, f"is not a readable .npz file ({type(err).__name__})", fix) from None
    if len(arrays) != 2:
        raise damaged(path, f"holds {names}, not 'mu' and 'sigma'", fix)
    mu, sigma = arrays["mu"], arrays["sigma"]
    if mu.shape != (dims,) or sigma.shape != (dims, dims):
        raise damaged(path, f"has mu {mu.shape} and sigma {sigma.shape}, not ({dims},) and ({dims}, {dims})", fix)
    if not (np.issubdtype(mu.dtype, np.number) and np.issubdtype(sigma.dtype, np.number)):
        raise damaged(path, f"holds {mu.dtype} and {sigma.dtype} values, not numbers", fix)
    mu, sigma = mu.astype(np.float64), sigma.astype(np.float64)
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise damaged(path, "holds NaN or inf in mu or sigma", fix)
    return mu, sigma
