"""Counter-based randomness and the batches a step reads.

Every random draw of step s comes from a generator seeded by (seed, s, stream): data order and augmentation on
the host (the data is read there), noise, noise levels, label drops and route draws on the training device. The
whole global batch is drawn and each process takes its slice, so a resumed run repeats an uninterrupted one and
N processes see what one process sees. CPU and CUDA generators give different streams for one seed: a run
repeats on the same device type.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from routing import ForceKeep
from train.data.masks import mask_inputs
from train.data.prefetch import Batch

# The streams of one step's generators (the third key of `seeded`).
NOISE, ORDER, AUGMENT, ROUTES, ALIGN = 0, 1, 2, 3, 4  # ALIGN: the self-alignment teacher's noise gap (align=self)


def seeded(*keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` determined by integer keys (seed, step, ...)."""
    return torch.Generator(device=device).manual_seed(hash(tuple(keys)) % (2**63))


def global_indices(seed: int, step: int, batch: int, n: int) -> torch.Tensor:
    """Dataset indices of step `step`'s global batch: consecutive slices of one permutation per epoch."""
    positions = torch.arange(step * batch, (step + 1) * batch)
    epochs = positions // n
    out = torch.empty(batch, dtype=torch.long)
    for epoch in epochs.unique().tolist():
        perm = torch.randperm(n, generator=seeded(seed, epoch, ORDER))
        here = epochs == epoch
        out[here] = perm[positions[here] % n]
    return out


class Batches:
    """The Trainer's data side: which samples a step reads, and reading them (ahead, on CUDA)."""

    def _global_indices(self, step: int) -> torch.Tensor:
        """Dataset indices of step `step`'s global batch; bucketed data draws each batch from one bucket."""
        if hasattr(self.dataset, "batch_indices"):
            return self.dataset.batch_indices(self.cfg.seed, step, self.cfg.trainer.batch_size)
        return global_indices(self.cfg.seed, step, self.cfg.trainer.batch_size, len(self.dataset))

    def _batch_shape(self) -> tuple[int, ...]:
        """The (C, H, W) of this step's samples: the dataset's, or the bucket's of this step's batch."""
        if hasattr(self.dataset, "shape_of"):
            return self.dataset.shape_of(self._global_indices(self.step))
        return self.dataset.shape

    def _load_batch(self, key: tuple[int, int]) -> Batch:
        """This process's micro-batch at `start` of step `step`, read on the host: a pure function of the key, so the
        CUDA path's prefetch thread reads it ahead. Clean images (b, C, H, W) and labels (b,); what REPA's encoder reads
        for them when the batch is not pixels (`align.source`: the images or features train.cache_latents stored beside
        the latents); and the masks from the data (name.mask.png, train/data/masks.py): force-kept tokens (b, N) bool
        and the loss weight (b, 1, *latent). Each of the last three is None when the run has none."""
        step, start = key
        indices = self._global_indices(step)[start : start + self.micro_batch]
        y, labels = self.dataset.get(indices, seeded(self.cfg.seed, step, AUGMENT, start))
        source = None if self.align is None else self.acc.unwrap_model(self.align).source
        clean = None if source is None else self.dataset.align_inputs(indices, source)
        keep, weight = None, None
        if hasattr(self.dataset, "masks"):  # only fine-tuned models' data has masks; only their backbones have a `patch`
            keep, weight = mask_inputs(self.dataset, indices, self.backbone.patch, self.cfg.data.get("mask_loss_weight"))
            # With its host copy: the routes count their subset sizes there, reading nothing back from the device.
            keep = None if keep is None else ForceKeep.of(keep)
        return y, labels, clean, keep, weight

    def _batch(self, micro: int, start: int) -> Batch:
        """This micro-batch (`_load_batch`); on CUDA the next one is read meanwhile on a thread, into pinned memory."""
        if self.prefetcher is None:
            return self._load_batch((self.step, start))
        last = micro == self.cfg.trainer.grad_accum - 1
        b, procs, rank = self.micro_batch, self.acc.num_processes, self.acc.process_index
        following = (self.step + 1, rank * b) if last else (self.step, ((micro + 1) * procs + rank) * b)
        return self.prefetcher.get((self.step, start), following)

    def _force_kept(self, keep: torch.Tensor | None):
        """Within: every route of the network's forwards processes the tokens `keep` marks (the adapter holds the mask,
        since net(x, t, labels) carries none)."""
        if keep is None:
            return nullcontext()
        return getattr(self.backbone, "adapter", self.backbone).keeping(keep)

    def _step_draws(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The global batch's noise levels (EDM: sigma; flow: t), noise and label drops of this step, drawn on the
        training device in this order from one generator of (seed, step)."""
        cfg, device = self.cfg, self.acc.device
        G = cfg.trainer.batch_size
        g = seeded(cfg.seed, self.step, NOISE, device=device)
        t_all = self.objective.sample_time(G, g, device=device)
        noise_all = torch.randn(G, *shape, generator=g, device=device)
        drop_all = torch.rand(G, generator=g, device=device) < cfg.edm.label_dropout
        return t_all, noise_all, drop_all

    def _align_draws(self) -> torch.Tensor:
        """The global batch's uniforms u (G,) for the EMA teacher's lower noise level (align=self), from a stream of their
        own: turning alignment on leaves the noise, levels, label drops and routes of every step as they were."""
        device = self.acc.device
        return torch.rand(self.cfg.trainer.batch_size, generator=seeded(self.cfg.seed, self.step, ALIGN, device=device), device=device)
