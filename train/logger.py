"""Metrics to metrics.jsonl (one JSON object per line) and to accelerate's trackers (trainer.log_with), on the main
process only."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, resume_step: int = 0, trackers=None):
        """`trackers`: an Accelerator whose trackers (init_trackers) get every logged value too, or None."""
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.trackers = trackers
        if not enabled:
            return
        if self.path.exists():
            # A killed run may have logged past its last checkpoint; keep only what the resume repeats from
            # (nothing for a fresh start: resume=auto that found no checkpoint).
            lines = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in lines))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.trackers is not None:
            self.trackers.log(metrics, step=step)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.end_training()
