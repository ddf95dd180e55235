"""Next-batch prefetch: a thread reads the batch after this one while the device trains on this one.

The trainer's batches are a pure function of (step, offset) (counter-based randomness), so the batch that
comes next is known in advance and a prefetched batch is bit-identical to one loaded on demand. With
`pin=True` the tensors land in page-locked memory, so their copy to the GPU can run asynchronously.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

# The trainer's (Batches._load_batch): images, labels, what REPA reads beside latents, force-kept tokens, loss weight
Batch = tuple[torch.Tensor | None, ...]


class Prefetcher:
    def __init__(self, load: Callable[[Hashable], Batch], pin: bool):
        # A bound method is held weakly: its owner (the trainer) owns this prefetcher and closes it when collected, so a
        # strong reference back would keep the trainer, its model and optimizer state alive for the whole process.
        self._load = weakref.WeakMethod(load) if inspect.ismethod(load) else lambda: load
        self.pin = pin
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending: tuple[Hashable, Future] | None = None

    def load(self, key: Hashable) -> Batch:
        batch = self._load()(key)
        return tuple(None if t is None else t.pin_memory() for t in batch) if self.pin else batch

    def get(self, key: Hashable, following: Hashable | None) -> Batch:
        """The batch `key` (prefetched if it was asked for last time); starts loading `following` meanwhile."""
        if self.pending is not None and self.pending[0] == key:
            batch = self.pending[1].result()
        else:
            batch = self.load(key)  # first call, or the order changed (resume): load on demand
        self.pending = (following, self.pool.submit(self.load, following)) if following is not None else None
        return batch

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
