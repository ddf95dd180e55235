"""Cost measurements shared by the benchmarks: FLOPs, interleaved step timing, saved-activation bytes.

Speed is only ever measured here, in benchmark scripts that print ratios from one run; tests never time.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable

import torch

from edm import EDM, Objective


def training_step(net, batch: int, shape, num_classes: int, device, seed: int = 0, lr: float = 1e-4,
                  objective: Objective | None = None) -> Callable[[], None]:
    """A closure running one training step (forward, backward, AdamW) of `objective` (default EDM with
    `net.sigma_data`) on fixed random data; `net` is that objective's wrapped network."""
    objective = objective if objective is not None else EDM(sigma_data=net.sigma_data)
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(batch, *shape, generator=g).to(device)
    labels = torch.randint(0, max(num_classes, 1), (batch,), generator=g).to(device)
    t = objective.sample_time(batch, g).to(device)  # EDM: sigma; flow: t
    noise = torch.randn(batch, *shape, generator=g).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, fused=torch.device(device).type == "cuda")  # as the trainer

    def loss() -> torch.Tensor:
        return objective.loss(net, y, labels, t, noise).mean()

    def step() -> None:
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.loss = loss  # forward only, for memory probes
    return step


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def step_clock(device, threads: int | None) -> tuple[Callable[[], float], str]:
    """The clock that times a training step, and its name.

    On a CPU with one thread, the process's CPU time: on a shared machine it leaves out the time the process waits
    for a core while other jobs run, which wall-clock time charges to whichever step was running (seen here:
    Mamba's unrouted step read 3.2 s instead of 1.7 s under a load of 3 on 2 cores). Everywhere else wall-clock
    time, which GPU work (asynchronous, synchronised around each call) and several threads need.
    """
    if torch.device(device).type == "cpu" and threads == 1:
        return time.process_time, "process CPU time (one thread)"
    return time.perf_counter, "wall-clock time"


def interleaved_medians(fns: dict[str, Callable[[], None]], repeats: int, warmup: int, device="cpu",
                        progress: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each function, alternating between them so machine noise hits all alike.

    `progress`, if given, is called after every call, outside the timed region (e.g. a progress bar's update).
    `clock` reads the time (see step_clock).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            if progress:
                progress()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            tic = clock()
            fn()
            _sync(device)
            times[name].append(clock() - tic)
            if progress:
                progress()
    return {name: statistics.median(ts) for name, ts in times.items()}


def saved_activation_bytes(loss_fn: Callable[[], torch.Tensor], params) -> int:
    """Bytes of the activations autograd saves for backward in one forward (each storage once, weights excluded)."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    return sum(seen.values())


def peak_memory_bytes(fn: Callable[[], None], device) -> int | None:
    """Peak CUDA memory of one call; None on CPU, where PyTorch keeps no such counter."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def now() -> str:
    """Local time to the second, for the dates the benchmarks record."""
    return datetime.datetime.now().isoformat(timespec="seconds")
