"""Cost measurements shared by the benchmarks: FLOPs, interleaved step timing, device and host time per call,
saved-activation bytes.

Speed is only ever measured here, in benchmark scripts that print ratios from one run; tests never time.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable

import torch

from edm import EDM, Objective
from train.compiling import tf32_matmuls


def training_step(net, batch: int, shape, num_classes: int, device, seed: int = 0, lr: float = 1e-4,
                  objective: Objective | None = None, align=None, ema=None) -> Callable[[], None]:
    """A closure running one training step (forward, backward, AdamW) of `objective` (default EDM with
    `net.sigma_data`) on fixed random data; `net` is that objective's wrapped network. `align` (an Alignment, as
    the trainer calls it) adds its loss, its teacher forward (`ema`, the EMA's wrapped network) and its projector."""
    objective = objective if objective is not None else EDM(sigma_data=net.sigma_data)
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(batch, *shape, generator=g).to(device)
    labels = torch.randint(0, max(num_classes, 1), (batch,), generator=g).to(device)
    t = objective.sample_time(batch, g).to(device)  # EDM: sigma; flow: t
    noise = torch.randn(batch, *shape, generator=g).to(device)
    u = torch.rand(batch, generator=g).to(device) if align is not None else None  # drawn last: the other draws stay as they were
    params = list(net.parameters()) + (list(align.parameters()) if align is not None else [])
    optimizer = torch.optim.AdamW(params, lr=lr, fused=torch.device(device).type == "cuda")  # as the trainer
    tf32_matmuls(device)  # as the trainer (the H100 side-by-side at 48e6353 ran its fp32 block after the route without)

    def loss() -> torch.Tensor:
        out = objective.loss(net, y, labels, t, noise).mean()
        return out if align is None else out + align(y, labels, t, noise, objective=objective, ema=ema, u=u)

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


def device_times(fns: dict, repeats: int, device) -> dict:
    """Per call of each function: (device seconds, host seconds) over `repeats` back-to-back calls, no sync between.

    device: CUDA events around the batch, the stream's time per call: the kernels' own time while the host keeps
    ahead of them (and the host path's, gaps included, when it does not). host: the time Python takes to issue
    one call. The synchronous wall time (`interleaved_medians`) holds both, one after the other; the host's share of
    it is what a CUDA graph or a thinner launch path can save. On a CPU the three are one: every value is None."""
    if torch.device(device).type != "cuda":
        return {name: None for name in fns}
    found = {}
    for name, fn in fns.items():
        fn()  # a first call compiles or tunes outside the timed batch
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        tic = time.perf_counter()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        host = (time.perf_counter() - tic) / repeats
        end.synchronize()
        found[name] = (start.elapsed_time(end) / 1e3 / repeats, host)
    return found


def device_columns(wall_s: float, times: tuple[float, float] | None) -> str:
    """`device_times`'s numbers beside a synchronous wall time, or what a CPU has instead."""
    if times is None:
        return "device time n/a on CPU (= wall)"
    device_s, host_s = times
    return f"device {device_s * 1e3:.3f} ms, host {host_s * 1e3:.3f} ms per call ({host_s / wall_s:.0%} of wall)"


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


# Peak DRAM bandwidth (bytes/s) of the cards the project measures on, from their data sheets: torch exposes no
# such property, so a card not listed prints its achieved bandwidth without a fraction.
CARD_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "L40S": 0.864e12, "RTX 4090": 1.008e12}


def card_bandwidth(device) -> float | None:
    """Peak DRAM bandwidth of `device` in bytes/s, or None off CUDA or for a card not in CARD_BANDWIDTH."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in CARD_BANDWIDTH.items() if key in name), None)


def roofline(bytes_moved: int, programs: int, seconds: float | None = None, device="cpu") -> str:
    """One line placing a kernel against the memory roofline: bytes it moves, programs it launches and, when
    timed on a card of known bandwidth, the achieved bandwidth as a fraction of the card's peak."""
    line = f"moves {bytes_moved / 1e6:.1f} MB in {programs:,} programs"
    peak = card_bandwidth(device)
    if peak is not None:
        line += f"; roofline {bytes_moved / peak * 1e3:.3f} ms"
        if seconds:
            line += f"; achieved {bytes_moved / seconds / 1e9:.0f} GB/s = {bytes_moved / seconds / peak:.0%} of peak"
    return line
