"""The EMA of an FSDP-sharded model, sharded as the model is.

A full EMA copy on every process would undo what sharding saves (a 14B model's fp32 EMA is 56 GB). Here each process
averages only its own shards of the trained parameters, with no communication. Whatever needs the EMA network as a
whole (preview grids, checkpoints, loading a resumed run's EMA) runs the sharded model itself inside `swapped`, which
exchanges the shards of the averaged and the trained weights, and exchanges them back on exit. What must run beside
the trained model within a step (align=self's EMA teacher) runs a sharded copy instead, filled by `copy_into`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from train.distributed.fsdp import local, reshard


class ShardedEma:
    def __init__(self, net: nn.Module, decay: float, use_warmup: bool):
        self.decay, self.use_warmup = decay, use_warmup
        self.averaged = [local(p).detach().clone() for p in self.trained(net)]
        self.names = [name for name, p in net.named_parameters() if p.requires_grad]  # of `averaged`, in its order

    @staticmethod
    def trained(net: nn.Module) -> list[nn.Parameter]:
        return [p for p in net.parameters() if p.requires_grad]

    def get_decay(self, step: int) -> float:
        """timm's ModelEmaV3.get_decay (update_after_step 0), as the unsharded EMAs use: 0 at the first update, then
        1 - (1 + s)^(-2/3) up to `decay`."""
        step = max(0, step - 1)
        if step <= 0:
            return 0.0
        return min(1 - (1 + step) ** (-2 / 3), self.decay) if self.use_warmup else self.decay

    @torch.no_grad()
    def update(self, net: nn.Module, step: int) -> None:
        torch._foreach_lerp_(self.averaged, [local(p) for p in self.trained(net)], 1.0 - self.get_decay(step))

    @torch.no_grad()
    def copy_into(self, twin: nn.Module) -> None:
        """The averaged shards into `twin`, a copy of the model sharded as it is (`sharded_copy`), parameter by name."""
        params = dict(twin.named_parameters())
        torch._foreach_copy_([local(params[name]) for name in self.names], self.averaged)

    @contextmanager
    def swapped(self, net: nn.Module) -> Iterator[nn.Module]:
        """`net` in eval mode holding the EMA weights; on exit its own weights (and mode) again, and the EMA whatever
        the EMA weights became inside (a resumed run loads them there)."""
        was_training = net.training
        self._exchange(net)
        try:
            yield net.eval()
        finally:
            self._exchange(net)
            net.train(was_training)

    @torch.no_grad()
    def _exchange(self, net: nn.Module) -> None:
        reshard(net)  # a forward without backward (sampling) leaves the root unit's weights gathered
        for averaged, p in zip(self.averaged, self.trained(net)):
            mine = local(p)
            kept = mine.clone()
            mine.copy_(averaged)
            averaged.copy_(kept)
