"""Metrics to metrics.jsonl (one JSON object per line) and TensorBoard, on the main process only."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        if self.path.exists():
            # A killed run may have logged past its last checkpoint; keep only what the resume repeats from
            # (nothing for a fresh start: resume=auto that found no checkpoint).
            lines = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in lines))
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
