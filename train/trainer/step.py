"""One optimizer step, with no host read.

The hot path: the step's draws on the device, each micro-batch's forward (the network `compile_network` returned:
eager, compiled per block or whole, CUDA graphs) and backward, the guarded AdamW and EMA update. Nothing here reads
a device value on the host; the losses and the guard's counts wait on the device until a logging step reads them
(`Guard._read`), so the host runs ahead of the device between logging steps.
"""

from __future__ import annotations

import time

import torch

from backbones.diffmoe import auxiliary_losses
from edm import reduce_loss, shift_time
from train.build import compiled_graphs
from train.distributed import reshard
from train.trainer.draws import ROUTES, seeded


class Step:
    """The Trainer's optimizer step."""

    def train_step(self) -> float | None:
        """One optimizer step. Its loss, read on the host, unless `fit` runs it between logging steps (None: the loss
        is read with the next logging step's)."""
        if self.compile_report_pending:
            began = time.perf_counter()
            self._step()
            loss = self._read()[-1]  # the first step compiles: wait for it
            self.compile_report_pending = False
            self.acc.print(f"trainer.compile={self.compile_mode}: first step (compiling) {time.perf_counter() - began:.1f} s, "
                           f"{compiled_graphs()} graphs")
            return loss
        self._step()
        if self.reading_due(self.step):
            return self._read()[-1]
        return None

    def _step(self) -> None:
        """One optimizer step over this process's micro-batches, queued on the device; nothing is read on the host."""
        cfg, acc = self.cfg, self.acc
        G, b = cfg.trainer.batch_size, self.micro_batch
        shape = self._batch_shape()
        t_all, noise_all, drop_all = self._step_draws(shape)  # the whole global batch's; this process takes its slices
        if self.train_shift is not None:
            t_all = shift_time(t_all, self.train_shift(shape))
        router = self.backbone.router
        routes = seeded(cfg.seed, self.step, ROUTES, device=acc.device)  # (seed, step) only: set_draws picks the rows
        u_all = self._align_draws() if self.align is not None else None  # the EMA teacher's noise gaps, a stream of their own
        teacher = self.ema_teacher() if self.align is not None else None  # for align=self teacher=ema
        modules = (self.net,) if self.align is None else (self.net, self.align)  # the projector trains beside the model
        losses, aux_sums = [], {}
        bad = torch.zeros((), dtype=torch.bool, device=acc.device)  # the divergence guard's flag
        for micro in range(cfg.trainer.grad_accum):
            start = (micro * acc.num_processes + acc.process_index) * b
            part = slice(start, start + b)
            # keep, weight: masks from the data (force-kept tokens, the loss weight); clean: what REPA's encoder reads
            y, labels, clean, keep, weight = (t if t is None else t.to(acc.device, non_blocking=True) for t in self._batch(micro, start))
            labels = torch.where(drop_all[part], self.dataset.num_classes, labels)  # null class for CFG
            router.set_draws(routes, start, G)  # a sample's route depends on (seed, step, its index) only
            with acc.accumulate(*modules), self._force_kept(keep):
                with acc.autocast():
                    per_elem = self.objective.loss(self.forward, y, labels, t_all[part], noise_all[part])
                    if weight is not None:
                        per_elem = per_elem * weight  # (b, C, *latent) x (b, 1, *latent): data.mask_loss_weight
                    masks = self.backbone.route_masks() if cfg.edm.loss == "route_aware" else None
                    diffusion = reduce_loss(per_elem, masks)
                    # Auxiliary losses of MoE blocks (load balance, capacity predictor); none for other families.
                    aux = auxiliary_losses(self.net)
                    loss = diffusion + sum(aux.values()) if aux else diffusion
                    if self.align is not None:
                        # lambda x the alignment loss of the forward just run (its hooks hold the aligned block's state)
                        aligned = self.align(y, labels, t_all[part], noise_all[part], objective=self.objective,
                                             ema=teacher, u=u_all[part], clean=clean)
                        if self.teacher is not None:
                            reshard(self.teacher)  # the root unit stays gathered after a forward without backward
                        loss = loss + aligned
                        aux = {**aux, "align": aligned}  # logged beside the MoE losses
                acc.backward(loss)
                bad = bad | ~torch.isfinite(loss.detach())
                if acc.sync_gradients:
                    # Clipping measures the gradient norm anyway; the guard reuses it instead of a second pass.
                    params = self.net.parameters() if self.align is None else [p for m in modules for p in m.parameters()]
                    norm = acc.clip_grad_norm_(params, cfg.trainer.grad_clip) if cfg.trainer.grad_clip else None
                    bad = self._finite_update(bad, norm)
                self.optimizer.zero_grad(set_to_none=True)
            losses.append(diffusion.detach())
            aux_sums = {k: aux_sums.get(k, 0) + v.detach() / cfg.trainer.grad_accum for k, v in aux.items()}
        self.step += 1
        self._finite_ema(bad)  # a skipped step leaves the EMA as it was
        self._count(bad, torch.stack(losses).mean(), aux_sums)
