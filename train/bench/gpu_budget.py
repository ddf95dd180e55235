"""Running the GPU check's sections inside a time budget, in order, with a progress line for each.

A section starts only if its estimated time fits what is left of the budget; otherwise it is skipped with a line
saying so (a shorter one later may still fit). A section still running at SECTION_STOP x its estimate (a compile
that hangs) or at STOP_AFTER x the whole budget is stopped there (SIGALRM, in the main thread), so the sections
after it keep their time and the report is always written. An exception in a section is recorded as one line,
never a traceback, and the next section runs. A stopped or failed section keeps the records it finished, and each
record is in the report as soon as it lands.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

STOP_AFTER = 1.25  # a section running past 1.25 x the budget is stopped
SECTION_STOP = 3.0  # ... and one running past 3 x its own estimate (not in a dry run, whose estimates are nominal)
DRY_RUN_ESTIMATE = 1.0  # seconds assumed for any section of the dry run (tiny shapes)


@dataclass
class Section:
    name: str
    title: str
    kind: str  # which table of the report its records join (train/bench/gpu_report.py TABLES)
    estimate_s: float  # a guess of its time on one H100
    run: Callable[..., dict]  # -> {"status", "records", "note"?}; called with the seconds left if needs_remaining
    needs_remaining: bool = False


@dataclass
class Progress:
    """The records the running section has finished, kept outside it: a stopped section still reports them, and
    the log shows each one as it lands, with the time. (The first H100 run stopped three sections after minutes of
    Triton compiles and kept nothing of them.) A section hands its records over through `collect`."""

    records: list = field(default_factory=list)
    log: Callable[[str], None] = print
    began: float = 0.0
    clock: Callable[[], float] = time.monotonic
    landed: Callable[[], None] = lambda: None  # after each record: the check rewrites its report

    def collect(self, records: Iterable[dict]) -> list[dict]:
        for record in records:
            self.records.append(record)
            self.log(f"[{self.clock() - self.began:5.0f} s]   {_describe(record)}")
            self.landed()
        return self.records


PROGRESS = Progress()


def _describe(record: dict) -> str:
    label = " ".join(str(record[k]) for k in ("kernel", "family", "check", "recipe", "precision", "shape") if k in record)
    outcome = "error" if "error" in record else {True: "passed", False: "FAILED"}.get(record.get("passed"), "measured")
    return f"{label}: {outcome}"


class OverBudget(BaseException):
    """Raised into a section that runs past the hard stop; a BaseException so that no `except Exception` keeps it."""


@contextlib.contextmanager
def hard_stop(seconds: float):
    """Raise OverBudget after `seconds` (only in the main thread, where signals are delivered; elsewhere no stop)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def stop(signum, frame):
        raise OverBudget()

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_sections(sections: list[Section], budget_s: float, dry_run: bool = False, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda line: print(line, flush=True),
                 after: Callable[[list[dict]], None] = lambda results: None) -> list[dict]:
    """Each section's record: name, title, kind, status (passed, failed, measured, error, skipped, stopped),
    seconds, estimate_s, note and records. `after` gets the records so far after each section that ran (the check
    writes its report then, so a call killed from outside keeps what it measured)."""
    began = clock()
    results = []
    for section in sections:
        estimate = DRY_RUN_ESTIMATE if dry_run else section.estimate_s
        elapsed = clock() - began
        left = budget_s - elapsed
        result = {"name": section.name, "title": section.title, "kind": section.kind, "estimate_s": estimate,
                  "seconds": None, "records": [], "note": ""}
        if estimate > left:
            result.update(status="skipped", note=f"needs about {estimate:.0f} s, {max(left, 0):.0f} s of the budget left")
            log(f"[{elapsed:5.0f} s] skip {section.name}: {result['note']}")
            results.append(result)
            continue
        log(f"[{elapsed:5.0f} s] {section.name}: {section.title} (about {estimate:.0f} s)")
        tic = clock()
        PROGRESS.records, PROGRESS.log, PROGRESS.began, PROGRESS.clock = [], log, began, clock
        # Each finished record goes into the report at once, the section marked unfinished: a call killed from outside
        # (a device's time limit, which may come before the hard stop) keeps what the section had measured.
        PROGRESS.landed = lambda: after(results + [{
            **result, "status": "stopped", "records": [{"section": section.name, **r} for r in PROGRESS.records],
            "note": f"unfinished when this report was written; {len(PROGRESS.records)} finished records kept"}])
        overall = STOP_AFTER * budget_s - elapsed
        limit = overall if dry_run else min(overall, SECTION_STOP * estimate)
        try:
            with hard_stop(limit):
                out = section.run(left) if section.needs_remaining else section.run()
            result.update(status=out["status"], records=[{"section": section.name, **r} for r in out["records"]],
                          note=out.get("note", ""))
        except OverBudget:
            why = f"{STOP_AFTER} x the budget" if limit == overall else f"{SECTION_STOP:.0f} x its estimate"
            result.update(status="stopped", records=[{"section": section.name, **r} for r in PROGRESS.records],
                          note=f"still running after {limit:.0f} s ({why}), stopped; {len(PROGRESS.records)} finished records kept")
        except Exception as err:  # noqa: BLE001 - the report says what failed, and the check goes on
            lines = str(err).strip().splitlines() or [""]
            result.update(status="error", records=[{"section": section.name, **r} for r in PROGRESS.records],
                          note=f"{type(err).__name__}: {lines[0][:300]}"
                               + (f"; {len(PROGRESS.records)} finished records kept" if PROGRESS.records else ""))
        finally:
            PROGRESS.landed = lambda: None  # no report of this call is written from outside it
        result["seconds"] = clock() - tic
        _release_memory()
        log(f"[{clock() - began:5.0f} s] {section.name}: {result['status']} in {result['seconds']:.0f} s"
            + (f"; {result['note']}" if result["note"] else ""))
        results.append(result)
        after(results)
    return results


def _release_memory() -> None:
    """Free what a section left behind (its models, their compiled graphs, cached GPU blocks) before the next."""
    import torch

    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
