"""Preemption: SIGTERM (SLURM, Kubernetes), SIGUSR1 (SLURM's --signal) and SIGINT (Ctrl-C) end a run at a step boundary
with a checkpoint of that step, one line naming it, and exit code 128 + the signal's number (143, 138, 130): Loop._preempt
raises train.cli.Preempted, which the commands turn into the line and the code.

The handler only records the signal: the step in flight finishes, and a second signal (while the checkpoint is being
written, say) changes nothing, so it cannot cut the save short. One process looks at its flag after every step (an
attribute read, no device read). Several processes must agree on the step they save, and a signal reaches them at
different moments, so they compare flags only where the loop reads the device anyway (logging, checkpoint and
last steps, `Loop.reading_due`): one all-reduce of a flag there, never on the other steps.
"""

from __future__ import annotations

import signal
import threading

import torch

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """While entered: the signals of SIGNALS are recorded (the first one kept) instead of ending the process; on exit
    the previous handlers come back. Outside the main thread (where Python cannot install handlers) it does nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _record(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> StopSignals:
        self.signum = None
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def agreed(self, acc, reading: bool) -> int | None:
        """The signal every process stops for at this step, or None. One process: its own flag. Several: the largest
        signal number any process received, compared at reading steps only (`reading`), so all stop at the same step."""
        if acc.num_processes == 1:
            return self.signum
        if not reading:
            return None
        flag = torch.tensor([self.signum or 0], device=acc.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # accelerate's reduce has no max
        return int(flag.item()) or None

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
