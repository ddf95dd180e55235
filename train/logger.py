"""Metrics to metrics.jsonl (one JSON object per line) and to accelerate's trackers (trainer.log_with), on the main
process only; and `recipe`, the routing recipe in words for the run's banner and train.sample."""

from __future__ import annotations

import json
from pathlib import Path

from train.files import read_metrics, write_atomic


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, resume_step: int = 0, records: list[tuple[str, int]] | None = None,
                 trackers=None):
        """`records`: the log's lines as read (and checked) before anything was written; read now when None.
        `trackers`: an Accelerator whose trackers (init_trackers) get every logged value too, or None."""
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.trackers = trackers
        if not enabled:
            return
        records = read_metrics(self.path) if records is None else records
        if self.path.exists():
            # A killed run may have logged past its last checkpoint; keep only what the resume repeats from
            # (nothing for a fresh start: resume=auto that found no checkpoint). One rename, so a crash here
            # leaves the old log whole.
            write_atomic(self.path, "".join(line + "\n" for line, step in records if step <= resume_step))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            end = f.tell()
            try:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
                f.flush()
            except OSError:
                f.truncate(end)  # a full disk must not leave half a line
                raise
        if self.trackers is not None:
            self.trackers.log(metrics, step=step)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.end_training()


def recipe(routing) -> str:
    """The routing recipe of a `routing` config group in words: SPRINT when a route fuses, else TREAD, with the
    selection policy (random, structured, rows, ...) and each route's span; e.g. "SPRINT (structured selection:
    0.75 bypass blocks 2..-3, path drop 0.1)". A config's `policy` alone (structured for routing=sprint and
    routing=structured alike) does not tell the recipes apart."""
    routes = list(routing.get("routes") or [])
    if not routes or routing.get("policy", "none") == "none":
        return "dense (no routing)"
    name = "SPRINT" if any(r.get("mode", "tread") == "sprint" for r in routes) else "TREAD"
    spans = []
    for r in routes:
        drop = f", path drop {r['path_drop']:g}" if r.get("path_drop") else ""
        spans.append(f"{r['selection_ratio']:g} bypass blocks {r['start_layer_idx']}..{r['end_layer_idx']}{drop}")
    return f"{name} ({routing.get('policy')} selection: {'; '.join(spans)})"
