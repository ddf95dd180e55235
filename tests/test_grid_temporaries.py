"""An animated grid (train/grid.py: video previews, train.sample) killed mid-write leaves a temporary that the next start
removes: its name carries the writer's pid, as every atomic write's does (train/files/atomic.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from train.rundir import remove_stale_temporaries

ROOT = Path(__file__).resolve().parent.parent

# Writes a 2-frame video grid into argv[1], killed (SIGKILL: no finally runs) at the rename that would publish it.
KILLED_WRITE = """
import os, signal, sys
import torch
from train.grid import save_grid
os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
save_grid(torch.rand(2, 1, 2, 8, 8), sys.argv[1], per_row=2)
"""


@pytest.mark.parametrize("name", ["step_0000002.gif", pytest.param("step_0000002.mp4", marks=pytest.mark.slow)])
def test_a_killed_video_grid_leaves_a_temporary_the_next_start_removes(tmp_path, name):
    samples = tmp_path / "run" / "samples"
    samples.mkdir(parents=True)
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(samples / name)], cwd=ROOT, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    left = sorted(p.name for p in samples.iterdir())
    assert len(left) == 1 and left[0].startswith(f".{name}.") and left[0].endswith(".tmp"), left
    removed = remove_stale_temporaries(tmp_path / "run")
    assert removed == [f"removed samples/{left[0]}"] and not list(samples.iterdir())
