"""The Trainer's set-up: every check before any work, then the objects a run trains with, then its first writes.

A refused run leaves every byte on disk as it was (docs/training.md, "Run folders"): `_set_up` reads and builds
but writes nothing; `_commit` writes once everything has passed.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf
from torch import nn

from routing import ConfigError
from train.build import build_ema, build_net, compile_mode, compile_network, finetune_family, objective_for, routed_blocks, time_shift
from train.compiling import check_regions, tf32_matmuls
from train.checkpoint import recover_checkpoints
from train.data import build_dataset
from train.data.prefetch import Prefetcher
from train.data.prompts import check_table
from train.data.validation_prompts import check_validation_prompts, encode_validation
from train.distributed import ShardedEma, shard_blocks, shard_projector, sharded_copy
from train.files import read_metrics
from train.files.atomic import pid_running
from train.logger import MetricsLogger
from train.metrics.alignment import align_name, build_alignment, zero_weight_note
from train.rundir import HydraRecord, move_aside, refuse_used, remove_stale_temporaries
from train.schema import check_config as schema_check
from train.schema.sample import preview_every


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
        if compile_mode(t.get("compile")) != "off":
            raise ConfigError(f"{fsdp} does not compile the network; set trainer.compile=off.")
        if cfg.fid.every:
            raise ConfigError(f"{fsdp} runs no FID during training (the processes would sample unequal shares through one sharded "
                              "model); set fid.every=0 and score a checkpoint with python -m train.fid.")
    if t.get("compile_regions"):
        kind = "fine-tuned" if finetune_family(cfg) else "diffmoe" if cfg.backbone.name == "diffmoe" else None
        check_regions(compile_mode(t.get("compile")), kind)
    per_step = num_processes * t.grad_accum
    if t.batch_size % per_step:
        raise ConfigError(
            f"trainer.batch_size={t.batch_size} is not divisible by {num_processes} processes x trainer.grad_accum={t.grad_accum}; "
            f"choose a multiple of {per_step}."
        )
    if t.mixed_precision == "fp16" and device is not None and device.type != "cuda":
        raise ConfigError(f"trainer.mixed_precision=fp16 needs a CUDA GPU, but this run is on the {device.type} (where it would "
                          "silently run in fp32); use trainer.mixed_precision=bf16 or no.")
    if preview_every(cfg) and cfg.data.name == "latents":
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
    check_validation_prompts(cfg)  # sample.prompts: its file, a text-to-image run, and that run's text encoders


class SetUp:
    """The Trainer's set-up and first writes."""

    def _set_up(self) -> None:
        """Everything that can refuse the run, with no write: the folder's state, data, model, optimizer, the
        checkpoint to resume and the metrics log."""
        cfg, t = self.cfg, self.cfg.trainer
        self._move_aside = not cfg.resume and refuse_used(self.run_dir, bool(cfg.get("overwrite")))
        self._stage = None  # new cache files of a captioned or video folder, until `_commit` publishes them (main process)
        self._shared_stage = None  # the main process's staging folder, which the other processes read meanwhile
        if cfg.data.name == "captions":
            # A captioned folder's refusals (a missing caption, an unreadable image) first; then its cache, which the
            # dataset reads, is brought up to date (beside the data, not in the run folder), staged until `_commit`.
            self._prepare_captions(self._list_captions())
        if cfg.data.name == "videos":
            self._prepare_videos(self._list_clips())  # likewise a video folder's
        self.dataset = build_dataset(self._staged_data(), cfg.edm.sigma_data)
        if len(self.dataset) == 0:
            raise ConfigError(f"data.name='{cfg.data.name}' has no samples; check data.path.")
        set_seed(cfg.seed)  # identical initial weights on every process and every run with this seed
        net = build_net(cfg, self.dataset, trained_from=self._trained_base())  # a changed base named before the data
        # sample.prompts, encoded once where previews are sampled (the main process; every process of a sharded run).
        here = preview_every(cfg) and (self.acc.is_main_process or self.acc.is_fsdp2)
        self.validation = encode_validation(cfg, net.model, self.acc.device, self.acc.print) if here else None
        self.backbone = net.model
        # Representation alignment (align=repa|self; None for none): hooks on the blocks now, before the EMA copy and any
        # compiling; the projector trains beside the model but is never part of it (docs/alignment.md).
        self.align = build_alignment(cfg, self.backbone, self.acc.device, dataset=self.dataset)
        if (note := zero_weight_note(cfg)) is not None:
            self.acc.print(note)
        self.micro_batch = t.batch_size // (self.acc.num_processes * t.grad_accum)
        self.objective = objective_for(cfg)
        # Fine-tuning may shift the training draws towards noise (SD3's fixed shift, Flux's per resolution); None: unshifted.
        self.train_shift = time_shift(cfg, "train", self.backbone.patch) if finetune_family(cfg) else None
        tf32_matmuls(self.acc.device)
        # Fused AdamW: one launch for every parameter, and `found_inf`, which lets the divergence guard skip a step
        # on the device (guard.py). Only trained parameters (all from scratch; the LoRA when fine-tuning) get state.
        # The projector (align=repa|self) is a second group: under FSDP it joins after accelerate has switched the model's
        # parameters to their shards (accelerate's FSDP2 prepares one model), and checkpoints of either kind then agree.
        sharded = self.acc.is_fsdp2
        groups = [{"params": [p for p in net.parameters() if p.requires_grad]}]
        groups += [{"params": list(self.align.parameters())}] if self.align is not None and not sharded else []
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, fused=True)
        self.ema = None if sharded else build_ema(cfg, net, self.acc.device)
        # align=self's EMA teacher under FSDP runs mid-step beside the trained model, whose root unit stays gathered
        # from forward to backward, so it cannot borrow those shards: it gets a sharded copy of its own (one more 1/N of
        # the weights per process), loaded with the EMA's shards each step (`ema_teacher`).
        self.teacher = None
        if sharded:
            shard_blocks(self.acc, [type(block).__name__ for block in routed_blocks(net)])  # one FSDP unit per block
            if self.align is not None and self.align.needs_ema:
                self.teacher = sharded_copy(self.acc, net)
                self.align.teacher_stops_early = False  # an exception mid-forward would leave FSDP's hooks mid-forward
        self.net, self.optimizer = self.acc.prepare(net, optimizer)
        if self.align is not None and sharded:
            shard_projector(self.align, self.optimizer.optimizer)  # sharded as the blocks are, its gradients reduce-scattered
        elif self.align is not None:
            self.align = self.acc.prepare(self.align)  # DDP all-reduces the projector's gradients
        if sharded:
            self.ema = ShardedEma(self.net, t.ema_decay, t.ema_warmup)  # sharded as the model is
        # After the EMA copy (a deep copy of a compiled block would call the original's compiled code). `forward` is what
        # the step calls: the network, or its whole compiled graph (trainer.compile=model), which `net` stays beside.
        self.compile_mode = compile_mode(t.get("compile"))
        self.forward = compile_network(self.net, self.backbone, self.compile_mode, bool(t.get("cuda_graphs", False)),
                                       regions=bool(t.get("compile_regions", False)), log=self.acc.print)
        self.compile_report_pending = self.compile_mode != "off"
        self.step = 0
        self.in_loop = False  # outside fit every step is read at once
        self.read_losses: list[float] = []  # every loss read so far
        self.prefetcher = Prefetcher(self._load_batch, pin=True) if self.acc.device.type == "cuda" else None
        if self.prefetcher is not None:
            weakref.finalize(self, self.prefetcher.close)
        self._start_guard()
        self._maybe_resume()
        # Divergence guard: the trained weights' norm at the start and at each checkpoint that passed.
        self.norms = [(self.step, self._weight_norm())]
        # The log this run continues (none when overwrite=true moves the old run aside, however damaged its log).
        keep = self.acc.is_main_process and not self._move_aside
        self._metrics = read_metrics(self.run_dir / "metrics.jsonl") if keep else []

    def _commit(self, record: HydraRecord | None) -> None:
        """The first writes, once every check has passed: the folder and its lock, what a killed save left, an
        old run moved aside (overwrite=true), Hydra's record and the metrics log trimmed for a resume."""
        if self.acc.num_processes > 1:
            self.acc.wait_for_everyone()  # every process's checks have passed (and none reads the staged cache any more)
        if self._claim is not None:
            self._claim.commit()
            for line in recover_checkpoints(self.run_dir / "checkpoints"):
                print(f"run_dir: {line} (left by an interrupted save)")
            for line in remove_stale_temporaries(self.run_dir):
                print(f"run_dir: {line} (left by an interrupted write)")
            if self._move_aside:
                self.acc.print(f"overwrite=true: moved the previous run in {self.run_dir} to {move_aside(self.run_dir)}")
            if record is not None:
                record.write(self.run_dir)
            self._publish_stage()
        self.acc.wait_for_everyone()
        if self._shared_stage is not None:  # the main process published the files this process read from its stage
            from train.data.caption_cache import cache_folder

            self.dataset.read_from(cache_folder(self.cfg.data))
            self._shared_stage = None
        self.logger = MetricsLogger(self.run_dir, self.acc.is_main_process, resume_step=self.step, records=self._metrics,
                                    trackers=self._start_trackers())

    def _list_captions(self) -> list:
        from train.data.captions import check_captions

        return check_captions(self.cfg)

    def _prepare_captions(self, items: list) -> None:
        """Encode a captioned folder's new or changed captions and images (main process), once per run: into a staging
        folder that `_commit` publishes into the cache; the other processes read it there meanwhile (`_share_stage`)."""
        from train.data.caption_cache import prepare_captions

        if self.acc.is_main_process:
            self._stage_cache(prepare_captions(self.cfg, device=self.acc.device, log=self.acc.print, items=items,
                                               stage=self._new_stage()))
        self._share_stage()

    def _new_stage(self) -> Path:
        """An empty folder outside the data folder for the cache files a run writes (the main process's)."""
        for old in Path(tempfile.gettempdir()).glob("tread_cache-*-*"):  # a killed run's (its pid no longer runs)
            pid = old.name.split("-")[1]
            if pid.isdigit() and not pid_running(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        self._stage = Path(tempfile.mkdtemp(prefix=f"tread_cache-{os.getpid()}-"))
        weakref.finalize(self, shutil.rmtree, self._stage, True)
        return self._stage

    def _stage_cache(self, folder: Path) -> None:
        if folder != self._stage:  # nothing new: the cache as it is
            self._remove_stage()

    def _share_stage(self) -> None:
        """Under several processes, each reads the main process's staging folder until `_commit` publishes it: the processes
        of one machine share its temporary folder. If one cannot see it (processes on several machines), the main process
        publishes the new files into the cache now, before the checks still to come, and every process reads them there."""
        self.acc.wait_for_everyone()
        if self.acc.num_processes == 1:
            return
        from accelerate.utils import broadcast_object_list, gather_object

        shared = broadcast_object_list([None if self._stage is None else str(self._stage)])[0]
        if shared is None:  # nothing new: every process reads the cache as it is
            return
        if all(gather_object([Path(shared).is_dir()])):
            self._shared_stage = None if self.acc.is_main_process else Path(shared)
            return
        if self.acc.is_main_process:
            from train.data.caption_cache import cache_folder, publish

            self.acc.print(f"data.cache: the staging folder {shared} is not visible to every process (several machines); "
                           f"wrote the new cache files into {cache_folder(self.cfg.data)} now, before the run's other checks")
            publish(self._stage, cache_folder(self.cfg.data))
            self._remove_stage()
        self.acc.wait_for_everyone()

    def _staged_data(self) -> DictConfig:
        """cfg.data, reading the cache from the staging folder while its new files wait there."""
        stage = self._stage or self._shared_stage
        if stage is None:
            return self.cfg.data
        data = copy.deepcopy(self.cfg.data)
        data.cache = str(stage)
        return data

    def _publish_stage(self) -> None:
        """Copy the staged cache files into the cache (every check has passed); the dataset reads them there from now on."""
        if self._stage is None:
            return
        from train.data.caption_cache import cache_folder, publish

        cache = cache_folder(self.cfg.data)
        names = publish(self._stage, cache)
        self.dataset.read_from(cache)
        self._remove_stage()
        print(f"data.cache: wrote {', '.join(names)} into {cache}")

    def _remove_stage(self) -> None:
        if getattr(self, "_stage", None) is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None

    def _list_clips(self) -> list:
        from train.data.videos import check_videos

        return check_videos(self.cfg)

    def _prepare_videos(self, clips: list) -> None:
        """Encode a video folder's new or changed captions and clips into its cache (main process), once per run, staged
        as a captioned folder's is."""
        from train.data.video_cache import prepare_videos

        if self.acc.is_main_process:
            self._stage_cache(prepare_videos(self.cfg, clips, device=self.acc.device, log=self.acc.print, stage=self._new_stage()))
        self._share_stage()

    def _release_run_dir(self) -> None:
        self._remove_stage()  # a refused run's staged cache files: the cache was never touched
        if self._claim is not None:
            self._claim.release()

    def _start_trackers(self) -> Accelerator | None:
        """Start accelerate's trackers of trainer.log_with (TensorBoard writes run_dir/tb/tread-zoo; wandb runs offline
        unless WANDB_MODE says otherwise); None when there are none."""
        if not self.acc.log_with:
            return None
        wandb = {"name": self.run_dir.name, "dir": str(self.run_dir), "mode": os.environ.get("WANDB_MODE", "offline")}
        self.acc.init_trackers("tread-zoo", config=flat_settings(self.cfg), init_kwargs={"wandb": wandb})
        return self.acc

    def ema_teacher(self) -> nn.Module | None:
        """The EMA network align=self's EMA teacher runs this step: the EMA's own copy, or under FSDP (when the teacher
        is the EMA) the sharded copy, loaded with the EMA's shards now."""
        if self.teacher is None:
            return getattr(self.ema, "module", None)
        self.ema.copy_into(self.teacher)
        return self.teacher

    @contextmanager
    def _ema_net(self) -> Iterator[nn.Module]:
        """The EMA network: the EMA's own copy; under FSDP, the sharded model holding the EMA weights meanwhile."""
        if isinstance(self.ema, ShardedEma):
            with self.ema.swapped(self.acc.unwrap_model(self.net)) as net:
                yield net
        else:
            yield self.ema.module
