"""metrics.jsonl: one JSON object with an integer `step` per line, appended as training goes.

A kill in the middle of an append leaves a last line without its newline that may not parse: that line is
what the resume repeats anyway, so it is dropped. Any other line that is not such an object was edited or
damaged, and is refused with its number. The trimmed log of a resume replaces the old
one in one rename (train/logger.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from train.files.typed import damaged, read_text

FIX = "fix or delete that line (every line is one JSON object with an integer \"step\")"


def read_metrics(path: Path) -> list[tuple[str, int]]:
    """Each complete line of the log with its step, in order ([] when there is no log)."""
    if not path.exists():
        return []
    text = read_text(path, FIX)
    lines = text.split("\n")
    cut_short = lines[-1] != ""  # the last append did not finish its line
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = number == len(lines)
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if last and cut_short:
                break  # half-written by a kill
            raise damaged(path, f"line {number} is not valid JSON", FIX) from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise damaged(path, f"line {number} has no integer \"step\"", FIX)
        records.append((line, step))
    return records
