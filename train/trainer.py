"""The training loop: EDM loss on any backbone with TREAD routing, on HF accelerate.

Randomness is counter-based: the noise, noise levels, label drops and data order of step s come from
generators seeded by (seed, s), drawn for the whole global batch and sliced per process. So a resumed run
repeats an uninterrupted one exactly, and N processes see the same global batch as one process.
"""

from __future__ import annotations

import json
import math
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm.auto import tqdm

from backbones.diffmoe import auxiliary_losses
from edm import generate, reduce_loss, shift_time
from routing import ConfigError
from train.build import (absolute_paths, build_ema, build_net, compile_blocks, compiled_graphs, describe_finetuning, finetune_family,
                         objective_for, routed_blocks, sampling_objective, time_shift)
from train.checkpoint import (NonFiniteWeights, latest_checkpoint, load_checkpoint, load_trained_state, recover_checkpoints, save_checkpoint,
                              trained_views)
from train.cli import RunStopped, is_disk_full
from train.data import build_dataset
from train.data.prefetch import Prefetcher
from train.data.prompts import check_table
from train.distributed import ShardedEma, fsdp_accelerator, full_tensors, optimizer_from_names, shard_blocks, shard_optimizer_state
from train.distributed.fsdp import local
from train.grid import grid_labels, save_grid
from train.files import read_metrics, write_atomic
from train.logger import MetricsLogger, recipe
from train.rundir import HydraRecord, RunDirClaim, check_run_dir, move_aside, refuse_used
from train.schema import check_config as schema_check
from train.schema import resume_changes
from train.schema.trainer import tracker_list

RECENT_NORMS = 5  # the divergence guard compares a checkpoint's weight norm with the start's and the last few checkpoints'


def seeded(*keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` determined by integer keys (seed, step, ...).

    CPU and CUDA generators give different streams for one seed, so a run repeats on the same device type.
    """
    return torch.Generator(device=device).manual_seed(hash(tuple(keys)) % (2**63))


def global_indices(seed: int, step: int, batch: int, n: int) -> torch.Tensor:
    """Dataset indices of step `step`'s global batch: consecutive slices of one permutation per epoch."""
    positions = torch.arange(step * batch, (step + 1) * batch)
    epochs = positions // n
    out = torch.empty(batch, dtype=torch.long)
    for epoch in epochs.unique().tolist():
        perm = torch.randperm(n, generator=seeded(seed, epoch, 1))
        here = epochs == epoch
        out[here] = perm[positions[here] % n]
    return out


def flat_settings(cfg: DictConfig) -> dict:
    """The resolved config as flat scalar settings (`trainer.lr: 0.001`), the form trackers store hyperparameters in."""
    def flat(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v if isinstance(v, (int, float, str, bool)) else json.dumps(v)

    return dict(flat({k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "hydra"}))


def check_config(cfg: DictConfig, num_processes: int = 1, device: torch.device | None = None) -> None:
    """Every cheap check before any work starts: the schema (types, ranges, backbone kwargs, FID paths,
    train/schema/), then what depends on the launch (the batch over processes, fp16 on this device) and the
    files the run will read later (the data's decoder, the FID reference and Inception weights, the prompt table)."""
    schema_check(cfg)
    t = cfg.trainer
    if t.get("distributed", "ddp") == "fsdp":
        fsdp = "trainer.distributed=fsdp"
        if num_processes < 2:
            raise ConfigError(f"{fsdp} shards the model over processes, but this run has one; launch it with `accelerate launch "
                              "--multi_gpu --num_processes N -m train ...` (N >= 2), or drop trainer.distributed=fsdp.")
        if t.get("compile"):
            raise ConfigError(f"{fsdp} does not compile blocks; drop trainer.compile.")
        if cfg.fid.every:
            raise ConfigError(f"{fsdp} runs no FID during training (the processes would sample unequal shares through one sharded "
                              "model); set fid.every=0 and score a checkpoint with python -m train.fid.")
    per_step = num_processes * t.grad_accum
    if t.batch_size % per_step:
        raise ConfigError(
            f"trainer.batch_size={t.batch_size} is not divisible by {num_processes} processes x trainer.grad_accum={t.grad_accum}; "
            f"choose a multiple of {per_step}."
        )
    if t.mixed_precision == "fp16" and device is not None and device.type != "cuda":
        raise ConfigError(f"trainer.mixed_precision=fp16 needs a CUDA GPU, but this run is on the {device.type} (where it would "
                          "silently run in fp32); use trainer.mixed_precision=bf16 or no.")
    if t.sample_every and cfg.data.name == "latents":
        from train.data.latents import check_vae

        check_vae(cfg.data)  # a missing VAE folder fails now, not at the first preview grid
    if cfg.data.name == "latents" and finetune_family(cfg):
        from train.data.latents_space import check_latent_space

        check_latent_space(cfg)  # a fine-tune trains in its pretrained model's latent space
    if cfg.fid.every:
        from train.metrics.fid import check_reference

        check_reference(cfg.fid.ref, cfg.fid.inception)  # not after the first round of FID samples
    if finetune_family(cfg) and cfg.finetune.prompts is not None:
        check_table(cfg.finetune.prompts, cfg.finetune.family)  # before the pretrained weights load


class Trainer:
    def __init__(self, cfg: DictConfig, accelerator: Accelerator | None = None, record: HydraRecord | None = None):
        """Check everything, then write: a refused run leaves every byte on disk as it was (docs/training.md,
        "Run folders"). `record`: Hydra's record of the command, written to <run_dir>/.hydra once checks passed."""
        self.cfg = cfg
        t = cfg.trainer
        if t.mixed_precision not in ("no", "bf16", "fp16"):
            raise ConfigError(f"trainer.mixed_precision='{t.mixed_precision}' is unknown; choose no, bf16 or fp16.")
        if accelerator is None:
            # accelerate keeps one process-wide state; several Trainers in one process (tests, the
            # benchmark grid) may ask for different precisions, so drop it (the process group stays).
            AcceleratorState._reset_state()
            # Trackers (trainer.log_with) log under run_dir/tb; configs saved before the key existed used TensorBoard.
            # trainer.distributed=fsdp: accelerate's FSDP2 plugin shards the model that `prepare` is given.
            make = fsdp_accelerator if t.get("distributed", "ddp") == "fsdp" else Accelerator
            accelerator = make(cpu=t.cpu, mixed_precision=t.mixed_precision, gradient_accumulation_steps=t.grad_accum,
                                      log_with=tracker_list(t.get("log_with", "tensorboard")) or None,
                                      project_dir=str(Path(cfg.run_dir) / "tb"))
        self.acc = accelerator
        check_config(cfg, self.acc.num_processes, self.acc.device)
        absolute_paths(cfg)
        self.run_dir = check_run_dir(cfg.run_dir)
        # An existing folder is locked (not written) while it is checked; the lock is committed with the first write.
        self._claim = RunDirClaim(self.run_dir) if self.acc.is_main_process else None
        if self._claim is not None:
            weakref.finalize(self, self._claim.release)
        try:
            self._set_up()
            self._commit(record)
        except BaseException:
            self._release_run_dir()
            raise

    # Set-up.

    def _set_up(self) -> None:
        """Everything that can refuse the run, with no write: the folder's state, data, model, optimizer, the
        checkpoint to resume and the metrics log."""
        cfg, t = self.cfg, self.cfg.trainer
        self._move_aside = not cfg.resume and refuse_used(self.run_dir, bool(cfg.get("overwrite")))
        if cfg.data.name == "captions":
            # A captioned folder's refusals (a missing caption, an unreadable image) first; then its cache, which the
            # dataset reads, is brought up to date (beside the data, not in the run folder).
            self._prepare_captions(self._list_captions())
        if cfg.data.name == "videos":
            self._prepare_videos(self._list_clips())  # likewise a video folder's
        self.dataset = build_dataset(cfg.data, cfg.edm.sigma_data)
        if len(self.dataset) == 0:
            raise ConfigError(f"data.name='{cfg.data.name}' has no samples; check data.path.")
        set_seed(cfg.seed)  # identical initial weights on every process and every run with this seed
        net = build_net(cfg, self.dataset)
        self.backbone = net.model
        self.micro_batch = t.batch_size // (self.acc.num_processes * t.grad_accum)
        self.objective = objective_for(cfg)
        # Fine-tuning may shift the training draws towards noise (SD3's fixed shift, Flux's per resolution); None: unshifted.
        self.train_shift = time_shift(cfg, "train", self.backbone.patch) if finetune_family(cfg) else None
        on_cuda = self.acc.device.type == "cuda"
        if on_cuda:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # fp32 matmuls on tensor cores
        # The fused kernel updates every parameter in one launch on CUDA; the CPU keeps the reference loop.
        # Only trained parameters (all of them from scratch; the LoRA when fine-tuning) get optimizer state.
        trained = [p for p in net.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, fused=on_cuda)
        sharded = self.acc.is_fsdp2
        self.ema = None if sharded else build_ema(cfg, net, self.acc.device)
        # Compiled after the EMA copy: a deep copy of a compiled block would call the original's compiled code.
        self.compile_report_pending = bool(t.get("compile"))
        if self.compile_report_pending:
            compile_blocks(self.backbone)
        if sharded:
            shard_blocks(self.acc, [type(block).__name__ for block in routed_blocks(net)])  # one FSDP unit per block
        self.net, self.optimizer = self.acc.prepare(net, optimizer)
        if sharded:
            self.ema = ShardedEma(self.net, t.ema_decay, t.ema_warmup)  # sharded as the model is
        self.step = 0
        self.prefetcher = Prefetcher(self._load_batch, pin=True) if self.acc.device.type == "cuda" else None
        if self.prefetcher is not None:
            weakref.finalize(self, self.prefetcher.close)
        self.last_aux: dict[str, float] = {}  # the last step's auxiliary losses (MoE), logged beside the loss
        self.skipped_steps = 0  # divergence guard: steps whose loss or gradient was non-finite (no update)
        self.bad_streak = 0  # ... of them in a row, up to now
        self._maybe_resume()
        # Divergence guard: the trained weights' norm at the start and at each checkpoint that passed.
        self.norms = [(self.step, self._weight_norm())]
        # The log this run continues (none when overwrite=true moves the old run aside, however damaged its log).
        keep = self.acc.is_main_process and not self._move_aside
        self._metrics = read_metrics(self.run_dir / "metrics.jsonl") if keep else []

    def _commit(self, record: HydraRecord | None) -> None:
        """The first writes, once every check has passed: the folder and its lock, what a killed save left, an
        old run moved aside (overwrite=true), Hydra's record and the metrics log trimmed for a resume."""
        if self._claim is not None:
            self._claim.commit()
            for line in recover_checkpoints(self.run_dir / "checkpoints"):
                print(f"run_dir: {line} (left by an interrupted save)")
            if self._move_aside:
                self.acc.print(f"overwrite=true: moved the previous run in {self.run_dir} to {move_aside(self.run_dir)}")
            if record is not None:
                record.write(self.run_dir)
        self.acc.wait_for_everyone()
        self.logger = MetricsLogger(self.run_dir, self.acc.is_main_process, resume_step=self.step, records=self._metrics,
                                    trackers=self._start_trackers())

    def _list_captions(self) -> list:
        from train.data.captions import check_captions

        return check_captions(self.cfg)

    def _prepare_captions(self, items: list) -> None:
        """Encode a captioned folder's new or changed captions and images into its cache (main process), once per run."""
        from train.data.caption_cache import prepare_captions

        if self.acc.is_main_process:
            prepare_captions(self.cfg, device=self.acc.device, log=self.acc.print, items=items)
        self.acc.wait_for_everyone()

    def _list_clips(self) -> list:
        from train.data.videos import check_videos

        return check_videos(self.cfg)

    def _prepare_videos(self, clips: list) -> None:
        """Encode a video folder's new or changed captions and clips into its cache (main process), once per run."""
        from train.data.video_cache import prepare_videos

        if self.acc.is_main_process:
            prepare_videos(self.cfg, clips, device=self.acc.device, log=self.acc.print)
        self.acc.wait_for_everyone()

    def _release_run_dir(self) -> None:
        if self._claim is not None:
            self._claim.release()

    def _apply_resume_changes(self, path: Path, saved_cfg: DictConfig) -> None:
        """Settings that differ from the checkpoint's: refuse those that change what the weights mean, apply the rest."""
        refused, applied = resume_changes(saved_cfg, self.cfg)
        if refused:
            raise ConfigError(f"checkpoint '{path}' was trained with other values of keys that cannot change on resume "
                              f"({'; '.join(refused)}); resume with the saved values or start a new run_dir.")
        t = self.cfg.trainer
        for group in self.optimizer.param_groups:  # the optimizer state just loaded carries the old ones
            group.update(lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        if applied:
            self.acc.print(f"resume: applying changed settings: {'; '.join(applied)}")

    def _maybe_resume(self) -> None:
        resume = self.cfg.resume
        if not resume:
            return
        ckpt_root = self.run_dir / "checkpoints"
        path = latest_checkpoint(ckpt_root) if resume in (True, "auto", "latest") else Path(str(resume))
        if path is None:
            if resume == "auto":
                return
            raise ConfigError(f"resume={'true' if resume is True else resume} but {ckpt_root} holds no checkpoint; drop resume= or "
                              "point run_dir= at the run to continue.")
        if not path.is_dir():
            raise ConfigError(f"resume={resume!r} is not a checkpoint folder; pass resume=auto or a step_* folder "
                              f"(e.g. resume={ckpt_root / 'step_0000100'}).")
        state = load_checkpoint(path, self.cfg)
        try:
            load_trained_state(self.acc.unwrap_model(self.net), state, "model", self.cfg)
            with self._ema_net() as ema:
                load_trained_state(ema, state, "ema", self.cfg)
        except RuntimeError as err:
            raise ConfigError(f"checkpoint '{path}' does not fit this model ({str(err).splitlines()[0]}); resume with the config it was trained with.") from err
        try:
            self._load_optimizer(state)
        except (KeyError, ValueError, TypeError) as err:
            raise ConfigError(f"checkpoint '{path}' holds an optimizer state that does not fit this model ({type(err).__name__}); "
                              "resume from an older step_* folder.") from None
        self._apply_resume_changes(path, state["config"])
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        self.acc.print(f"resumed from {path} at step {self.step}")

    def _load_optimizer(self, state: dict) -> None:
        """AdamW's state from a checkpoint, keyed by position (one process, DDP) or by parameter name (FSDP's full state
        dict): either kind resumes either way."""
        trained = [(n, p) for n, p in self.acc.unwrap_model(self.net).named_parameters() if p.requires_grad]  # its order
        saved = state["optimizer"]
        if state.get("optimizer_keys") == "names":
            saved = optimizer_from_names(saved, [n for n, _ in trained])
        if self.acc.is_fsdp2:
            saved = shard_optimizer_state(saved, [p for _, p in trained])
        self.optimizer.load_state_dict(saved)

    @contextmanager
    def _ema_net(self) -> Iterator[nn.Module]:
        """The EMA network: the EMA's own copy; under FSDP, the sharded model holding the EMA weights meanwhile."""
        if isinstance(self.ema, ShardedEma):
            with self.ema.swapped(self.acc.unwrap_model(self.net)) as net:
                yield net
        else:
            yield self.ema.module

    def _gather_checkpoint(self) -> dict:
        """Full state dicts of a sharded run, gathered by every process, kept by the main one: the trained tensors, their
        EMA and AdamW's state (by parameter name), so the checkpoint loads on one process too."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        net, main = self.acc.unwrap_model(self.net), self.acc.is_main_process
        model = full_tensors(trained_views(net, self.cfg), main)
        with self._ema_net() as ema:
            ema_state = full_tensors(trained_views(ema, self.cfg), main)
        optimizer = get_optimizer_state_dict(net, self.optimizer.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {"model": model, "ema": ema_state, "optimizer": optimizer}

    def _start_trackers(self) -> Accelerator | None:
        """Start accelerate's trackers of trainer.log_with (TensorBoard writes run_dir/tb/tread-zoo; wandb runs offline
        unless WANDB_MODE says otherwise); None when there are none."""
        if not self.acc.log_with:
            return None
        wandb = {"name": self.run_dir.name, "dir": str(self.run_dir), "mode": os.environ.get("WANDB_MODE", "offline")}
        self.acc.init_trackers("tread-zoo", config=flat_settings(self.cfg), init_kwargs={"wandb": wandb})
        return self.acc

    # One optimizer step.

    def train_step(self) -> float:
        acc = self.acc
        if self.compile_report_pending:
            began = time.perf_counter()
            loss = self._train_step()
            self.compile_report_pending = False
            acc.print(f"trainer.compile: first step (compiling) {time.perf_counter() - began:.1f} s, {compiled_graphs()} graphs")
            return loss
        return self._train_step()

    def _train_step(self) -> float:
        cfg, acc = self.cfg, self.acc
        G, b = cfg.trainer.batch_size, self.micro_batch
        # Draw the whole global batch's randomness, then take this process's slices.
        g = seeded(cfg.seed, self.step, 0)
        t_all = self.objective.sample_time(G, g)  # EDM: sigma; flow: t
        shape = self._batch_shape()
        noise_all = torch.randn(G, *shape, generator=g)
        drop_all = torch.rand(G, generator=g) < cfg.edm.label_dropout
        if self.train_shift is not None:
            t_all = shift_time(t_all, self.train_shift(shape))
        losses, aux_sums = [], {}
        bad, skip = torch.zeros((), dtype=torch.bool, device=acc.device), False  # divergence guard
        for micro in range(cfg.trainer.grad_accum):
            start = (micro * acc.num_processes + acc.process_index) * b
            part = slice(start, start + b)
            y, labels = self._batch(micro, start)
            labels = torch.where(drop_all[part], self.dataset.num_classes, labels)  # null class for CFG
            # Routing draws on the training device: a CPU draw copied to the GPU at every route would block the
            # host until the GPU queue drains (a pageable copy), breaking launch overlap.
            self.backbone.router.generator = seeded(cfg.seed, self.step, 3, start, device=acc.device)
            with acc.accumulate(self.net):
                with acc.autocast():
                    y, labels = y.to(acc.device, non_blocking=True), labels.to(acc.device, non_blocking=True)
                    per_elem = self.objective.loss(self.net, y, labels, t_all[part].to(acc.device), noise_all[part].to(acc.device))
                    masks = self.backbone.route_masks() if cfg.edm.loss == "route_aware" else None
                    diffusion = reduce_loss(per_elem, masks)
                    # Auxiliary losses of MoE blocks (load balance, capacity predictor); none for other families.
                    aux = auxiliary_losses(self.net)
                    loss = diffusion + sum(aux.values()) if aux else diffusion
                acc.backward(loss)
                bad = bad | ~torch.isfinite(loss.detach())
                if acc.sync_gradients:
                    # Clipping measures the gradient norm anyway; the guard reuses it instead of a second pass.
                    norm = acc.clip_grad_norm_(self.net.parameters(), cfg.trainer.grad_clip) if cfg.trainer.grad_clip else None
                    skip = self._non_finite(bad, norm)  # all processes agree, so DDP stays in lockstep
                if not skip:
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            losses.append(diffusion.detach())
            aux_sums = {k: aux_sums.get(k, 0) + v.detach() / cfg.trainer.grad_accum for k, v in aux.items()}
        self.step += 1
        # One reduce and one host read for the loss and every auxiliary loss together.
        reduced = acc.reduce(torch.stack([torch.stack(losses).mean(), *aux_sums.values()]), reduction="mean").tolist()
        self.last_aux = dict(zip(aux_sums, reduced[1:]))
        self.skipped_steps += skip
        self.bad_streak = self.bad_streak + 1 if skip else 0
        if not skip:  # a skipped step leaves the weights as they were; the EMA skips it too
            self.ema.update(self.acc.unwrap_model(self.net), step=self.step)
        return reduced[0]

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

    def _load_batch(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Clean images and labels of this process's micro-batch at `start` of step `step`: a pure function of the key."""
        step, start = key
        indices = self._global_indices(step)
        return self.dataset.get(indices[start : start + self.micro_batch], seeded(self.cfg.seed, step, 2, start))

    def _batch(self, micro: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch; on CUDA the next one is read meanwhile on a thread, into pinned memory."""
        if self.prefetcher is None:
            return self._load_batch((self.step, start))
        last = micro == self.cfg.trainer.grad_accum - 1
        b, procs, rank = self.micro_batch, self.acc.num_processes, self.acc.process_index
        following = (self.step + 1, rank * b) if last else (self.step, ((micro + 1) * procs + rank) * b)
        return self.prefetcher.get((self.step, start), following)

    def _non_finite(self, bad: torch.Tensor, norm: torch.Tensor | None = None) -> bool:
        """True when the loss (`bad`) or, without an fp16 loss scaler (which skips overflowing steps itself),
        the gradient is non-finite on any process; `norm`, the total gradient norm when clipping measured it.
        One host sync per optimizer step; the loss reduce that follows syncs anyway."""
        if self.acc.scaler is None:
            if norm is None:
                grads = [local(p.grad) for p in self.net.parameters() if p.grad is not None]  # this process's shards
                norm = torch.stack(torch._foreach_norm(grads)).sum() if grads else torch.zeros((), device=bad.device)
            bad = bad | ~torch.isfinite(local(norm))  # FSDP's total norm is a replicated DTensor
        if self.acc.num_processes > 1:
            bad = self.acc.reduce(bad.float().reshape(1), reduction="sum") > 0
        return bool(bad)

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

    def _stop_diverged(self) -> None:
        good = self._good_checkpoint()
        self._release_run_dir()
        self.logger.close()
        raise RunStopped(f"training diverged: {self.bad_streak} steps in a row (up to step {self.step}) had a non-finite loss or "
                         f"gradient and were skipped (trainer.max_bad_steps={self.cfg.trainer.max_bad_steps}); {good}.")

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

    def _stop_on_write(self, what: str, err: BaseException) -> RunStopped:
        """A write that failed mid-run (a full disk, a folder made read-only): the run stops with exit code 3."""
        full = is_disk_full(err)
        good = self._good_checkpoint("free space, then continue from it" if full else "fix the folder, then continue from it", lr=False)
        self._release_run_dir()
        detail = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
        return RunStopped(f"could not write {what}: {'the disk is full' if full else 'writing failed'} ({detail}); "
                          f"nothing else was changed, and {good}.")

    # The loop.

    def fit(self) -> list[float]:
        cfg, t = self.cfg, self.cfg.trainer
        if self.acc.is_main_process:
            self._write("config.yaml", lambda: write_atomic(self.run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True)))
        params = sum(p.numel() for p in self.backbone.parameters())
        model = (describe_finetuning(cfg, self.acc.unwrap_model(self.net)) if finetune_family(cfg) else
                 f"{cfg.backbone.name}-{cfg.backbone.preset}/{cfg.backbone.patch_size} ({params / 1e6:.2f}M params)")
        self.acc.print(f"{model}, "
                       f"routing={recipe(cfg.routing)}, data={cfg.data.name} {tuple(self.dataset.shape)}, "
                       f"{self.acc.num_processes} process(es) on {self.acc.device}, run_dir={self.run_dir}")
        losses = []
        budget = t.max_minutes * 60 if t.max_minutes else math.inf
        began = time.perf_counter()
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not self.acc.is_main_process, desc="train", dynamic_ncols=True)
        try:
            while self.step < t.max_steps:
                tic = time.perf_counter()
                loss = self.train_step()
                seconds = time.perf_counter() - tic
                losses.append(loss)
                images_per_s = t.batch_size / seconds
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{images_per_s:.0f}")
                last = self.step == t.max_steps or time.perf_counter() - began > budget
                if self.step % t.log_every == 0 or last or self.bad_streak == 1:
                    self._write("metrics.jsonl", self.logger.log, self.step, {
                        "loss": loss, **self.last_aux, "images_per_s": images_per_s, "seconds": time.perf_counter() - began,
                        "skipped_steps": self.skipped_steps})
                if self.bad_streak == 1:
                    self.acc.print(f"step {self.step}: non-finite loss or gradient; the step is skipped (no update, no EMA)")
                if self.bad_streak >= t.max_bad_steps:
                    self._stop_diverged()
                # Save first: a failing preview must not cost the checkpoint of its step. No checkpoint while the
                # newest step was non-finite: the weights that produced it must not rotate out good ones.
                if t.ckpt_every and (self.step % t.ckpt_every == 0 or last) and not self.bad_streak:
                    self.save()
                if t.sample_every and (self.step % t.sample_every == 0 or last):
                    self.sample_grid()
                if cfg.fid.every and (self.step % cfg.fid.every == 0 or last):
                    self.evaluate_fid()
                if last:
                    break
        finally:
            bar.close()  # before any message of a stopped run, so it starts a line of its own
        self.logger.close()
        self._release_run_dir()
        return losses

    def evaluate_fid(self) -> float:
        """FID of the EMA model; every process samples its share, all get the same value."""
        from train.metrics.fid import compute_fid

        fid = compute_fid(self.ema.module.eval(), self.dataset, self.cfg.fid, self.acc, self.objective)
        self._write("metrics.jsonl", self.logger.log, self.step, {"fid": fid})
        self.acc.print(f"step {self.step}: FID {fid:.2f}")
        return fid

    def _write(self, what: str, write, *args):
        """Run `write(*args)`; a failed write stops the run in one sentence naming the last good checkpoint."""
        try:
            return write(*args)
        except OSError as err:
            raise self._stop_on_write(f"{what} in {self.run_dir}", err) from None

    def save(self) -> None:
        """Checkpoint this step; never from non-finite or exploded weights, and a failed write names the last good one."""
        self.acc.wait_for_everyone()
        ckpt_root = self.run_dir / "checkpoints"
        self._check_weight_growth()  # every process computes the same norm, so all stop alike
        try:
            sharded = isinstance(self.ema, ShardedEma)
            gathered = self._gather_checkpoint() if sharded else None  # every process takes part in the gathers
            if self.acc.is_main_process:
                ema = self.acc.unwrap_model(self.net) if sharded else self.ema.module
                save_checkpoint(ckpt_root, self.step, self.acc.unwrap_model(self.net), ema,
                                self.optimizer, self.cfg, keep=self.cfg.trainer.keep_checkpoints, gathered=gathered)
        except NonFiniteWeights as err:
            good = self._good_checkpoint()
            self._release_run_dir()
            raise RunStopped(f"could not save the checkpoint of step {self.step} in {ckpt_root}: the weights hold NaN or inf "
                             f"({err}); {good}.") from None
        except OSError as err:
            raise self._stop_on_write(f"the checkpoint of step {self.step} in {ckpt_root}", err) from None
        self.acc.wait_for_everyone()

    def sample_grid(self) -> Path | None:
        """EMA samples with fixed seed and labels, so grids are comparable across steps."""
        s = self.cfg.sample
        path = self.run_dir / "samples" / f"step_{self.step:07d}.png"
        # A sharded model samples on every process (each forward gathers its weights); the main one writes the grid.
        if self.acc.is_main_process or isinstance(self.ema, ShardedEma):
            # One row per class; a captioned set shows its first captions.
            labels = grid_labels(getattr(self.dataset, "preview_classes", self.dataset.num_classes), s.per_class)
            with self._ema_net() as ema:
                ema = ema.eval()
                objective = sampling_objective(self.cfg, self.objective, self.backbone, self.dataset.shape)
                x = generate(ema, labels, shape=self.dataset.shape, steps=s.steps, guidance=s.guidance, seed=s.seed,
                             device=self.acc.device, null_label=self.dataset.num_classes, objective=objective,
                             router=ema.model.router)
            if self.acc.is_main_process:
                path = self._write(f"the sample grid {path.name}", save_grid, self.dataset.to_images(x), path, s.per_class)
        self.acc.wait_for_everyone()
        return path
