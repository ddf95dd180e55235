"""The divergence guard, decided on the device.

A step whose loss or gradient is non-finite on any process leaves the weights, AdamW's state and the EMA as they
were, without the host reading a flag: the flag is AdamW's `found_inf` (the fused kernel skips the update and
undoes its step count, as it does for a loss scaler), the EMA moves by a weight multiplied by the finite flag,
and the skipped steps and the current run of them are counted in a device tensor. The host reads the counts
with the losses at logging steps (`_read`): a run stops after trainer.max_bad_steps skipped steps in a row,
found at the read that sees them. Exploding but finite weights are caught where a checkpoint is written.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from train.cli import RunStopped
from train.checkpoint import latest_checkpoint
from train.distributed import ShardedEma
from train.distributed.fsdp import local

RECENT_NORMS = 5  # a checkpoint's weight norm is compared with the start's and the last few checkpoints'


def ema_pairs(ema, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(averaged tensors, the model's tensors they follow, (copy, source) of tensors copied instead): the trained
    tensors for the fine-tuning and sharded EMAs; for timm's ModelEmaV3, as its own update pairs them, every floating
    tensor of the state dict averaged and the others (DiffMoE's update count) copied."""
    if hasattr(ema, "averaged"):
        return ema.averaged, [local(p.detach()) for p in model.parameters() if p.requires_grad], []
    pairs = list(zip(ema.module.state_dict().values(), model.state_dict().values()))
    floats = [(e, m) for e, m in pairs if e.is_floating_point()]
    return [e for e, _ in floats], [m for _, m in floats], [(e, m) for e, m in pairs if not e.is_floating_point()]


class Guard:
    """The Trainer's divergence guard and its host reads."""

    def _start_guard(self) -> None:
        device = self.acc.device
        self.counts = torch.zeros(2, dtype=torch.long, device=device)  # [skipped steps, skipped in a row up to now]
        self.pending: list[torch.Tensor] = []  # per unread step: (1 + aux,) losses on the device, this process's
        self.aux_names: list[str] = []
        self.skipped_steps = 0  # as of the last read
        self.bad_streak = 0  # ... of them in a row, up to the step read
        self.last_aux: dict[str, float] = {}  # the last read step's auxiliary losses (MoE), logged beside the loss

    def _finite_update(self, bad: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """Step AdamW unless the loss (`bad`) or the gradient is non-finite on any process; returns that flag, on the
        device. `norm`: the total gradient norm when clipping measured it (the guard reuses it). With an fp16 loss
        scaler the scaler skips overflowing steps itself and owns `found_inf`."""
        if self.acc.scaler is None:
            if norm is None:
                grads = [local(p.grad) for p in self.net.parameters() if p.grad is not None]  # this process's shards
                norm = torch.stack(torch._foreach_norm(grads)).sum() if grads else torch.zeros((), device=bad.device)
            bad = bad | ~torch.isfinite(local(norm))  # FSDP's total norm is a replicated DTensor
        if self.acc.num_processes > 1:  # all processes agree (a collective, not a host read), so DDP stays in lockstep
            bad = self.acc.reduce(bad.float().reshape(1), reduction="sum").reshape(()) > 0
        inner = self.optimizer.optimizer  # torch's AdamW under accelerate's wrapper
        if self.acc.scaler is None:
            inner.found_inf = bad.float()  # the fused kernel leaves params and state unchanged where it is 1
        self.optimizer.step()
        inner.__dict__.pop("found_inf", None)
        return bad

    @torch.no_grad()
    def _finite_ema(self, bad: torch.Tensor) -> None:
        """The EMA update of this step (self.step, counted from 1), by a weight that is 0 for a skipped step."""
        model = self.acc.unwrap_model(self.net)
        averaged, current, copied = ema_pairs(self.ema, model)
        weight = (~bad).to(averaged[0].dtype if averaged else torch.float32) * (1.0 - self.ema.get_decay(self.step))
        if averaged:
            torch._foreach_lerp_(averaged, current, [weight] * len(averaged))
        for copy, source in copied:
            copy.copy_(torch.where(bad, copy, source))

    def _count(self, bad: torch.Tensor, losses: torch.Tensor, aux: dict[str, torch.Tensor]) -> None:
        """Keep this step's flag and losses on the device until the next read."""
        bad = bad.long()
        self.counts = torch.stack([self.counts[0] + bad, (self.counts[1] + 1) * bad])
        self.aux_names = list(aux)
        self.pending.append(torch.stack([losses, *aux.values()]))

    def _read(self) -> list[float]:
        """The host read: the losses of every step since the last read (averaged over processes, one collective) and
        the guard's counts; says when steps were skipped, and stops the run after trainer.max_bad_steps in a row."""
        if not self.pending:
            return []
        rows = self.acc.reduce(torch.stack(self.pending), reduction="mean").tolist()  # (steps, 1 + aux)
        self.pending = []
        self.last_aux = dict(zip(self.aux_names, rows[-1][1:]))
        skipped, streak = self.counts.tolist()
        if skipped > self.skipped_steps:
            self.acc.print(f"step {self.step}: {skipped - self.skipped_steps} step(s) since the last read had a non-finite loss "
                           f"or gradient and were skipped (no update, no EMA); {streak} in a row up to now")
        self.skipped_steps, self.bad_streak = skipped, streak
        losses = [row[0] for row in rows]
        self.read_losses.extend(losses)
        return losses

    def _check_streak(self) -> None:
        if self.bad_streak < self.cfg.trainer.max_bad_steps:
            return
        good = self._good_checkpoint()
        self._release_run_dir()
        self.logger.close()
        raise RunStopped(f"training diverged: {self.bad_streak} steps in a row (up to step {self.step}) had a non-finite loss or "
                         f"gradient and were skipped (trainer.max_bad_steps={self.cfg.trainer.max_bad_steps}); {good}.")

    def _weight_norm(self) -> float:
        """L2 norm of the trained weights (every parameter from scratch; the LoRA when fine-tuning)."""
        params = [p.detach() for p in self.acc.unwrap_model(self.net).parameters() if p.requires_grad]
        if isinstance(self.ema, ShardedEma):  # each process holds shards: the squares of theirs add up over processes
            square = torch.stack(torch._foreach_norm([local(p) for p in params])).double().square().sum()
            return float(self.acc.reduce(square.reshape(1), reduction="sum").sqrt())
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(params)).double())) if params else 0.0

    def _good_checkpoint(self, then: str = "continue from it with a smaller learning rate", lr: bool = True) -> str:
        """The newest checkpoint (every saved one passed the guard), and how to go on from it, for a stopped run."""
        ckpt_root = self.run_dir / "checkpoints"
        latest = latest_checkpoint(ckpt_root) if ckpt_root.is_dir() else None
        if latest is None:
            return "no checkpoint was written before it"
        return (f"the last good checkpoint is {latest}; {then} "
                f"(python -m train run_dir={self.run_dir} resume={latest}{' trainer.lr=...' if lr else ''})")

    def _check_weight_growth(self) -> None:
        """Refuse to checkpoint weights whose norm jumped far beyond the run's recent history (exploding but finite, as
        with a learning rate far too high), so they never rotate out a good checkpoint; the run stops (exit code 3)."""
        growth = self.cfg.trainer.get("max_weight_growth")
        norm = self._weight_norm()
        reference = max(n for _, n in self.norms[-RECENT_NORMS:])
        if growth is None or reference == 0 or (math.isfinite(norm) and norm <= growth * reference):
            self.norms.append((self.step, norm))
            return
        good = self._good_checkpoint()
        self._release_run_dir()
        self.logger.close()
        raise RunStopped(f"training diverged: the weights' norm at step {self.step} is {norm:.3g}, more than "
                         f"trainer.max_weight_growth={growth:g} times the largest of the run's recent checkpoints "
                         f"({reference:.3g}), so the checkpoint of step {self.step} was not saved; {good} "
                         f"(or widen the check: trainer.max_weight_growth=...).")
