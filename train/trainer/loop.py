"""The loop around the step: progress, logging, checkpoints, previews and FID.

Between logging steps the loop only counts; at a logging step (and wherever it checkpoints, samples, scores FID or
ends) it reads the losses and the guard's counts from the device in one go. The progress bar shows the last loss
read, and images/s is the wall time over the steps since the previous read (the read waits for them to finish), or
since the checkpoint, preview or FID score done after it, which are not training steps; the bar's own rate (s/it) and
elapsed time leave them out too (`leave_out`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from omegaconf import OmegaConf
from tqdm.auto import tqdm

from edm import generate
from train.build import describe_finetuning, finetune_family, objective_name, sampling_objective
from train.checkpoint import NonFiniteWeights, save_checkpoint
from train.cli import Preempted, RunStopped, is_disk_full
from train.data.validation_prompts import conditioned_on
from train.distributed import ShardedEma
from train.files import write_atomic
from train.grid import grid_labels, save_grid
from train.logger import recipe
from train.trainer.preemption import StopSignals
from train.schema.sample import preview_every


def leave_out(bar, seconds: float) -> None:
    """Shift a tqdm bar's clock by `seconds` of work that is no training step (a checkpoint, a preview, FID), so its
    rate (s/it) and elapsed time leave it out. tqdm's own `unpause()` moves the clock by all the time since the bar's
    last print, which would drop the steps run since that print too (a print waits for mininterval, 0.1 s, and for
    miniters steps): its two timestamps are moved by the pause alone, as unpause moves them."""
    if bar.disable:
        return
    bar.start_t += seconds
    bar.last_print_t += seconds


class Loop:
    """The Trainer's loop and what it writes."""

    def reading_due(self, step: int) -> bool:
        """Whether step `step` reads the device: always outside `fit`; in it, where it logs, checkpoints, samples or ends."""
        if not self.in_loop:
            return True
        t, every, previews = self.cfg.trainer, self.cfg.fid.every, preview_every(self.cfg)
        return (step % t.log_every == 0 or step >= t.max_steps or bool(t.ckpt_every and step % t.ckpt_every == 0)
                or bool(previews and step % previews == 0) or bool(every and step % every == 0))

    def fit(self) -> list[float]:
        """Train to trainer.max_steps (or trainer.max_minutes); returns the loss of every step run."""
        cfg, t, previews = self.cfg, self.cfg.trainer, preview_every(self.cfg)
        if self.acc.is_main_process:
            self._write("config.yaml", lambda: write_atomic(self.run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True)))
        params = sum(p.numel() for p in self.backbone.parameters())
        model = (describe_finetuning(cfg, self.acc.unwrap_model(self.net)) if finetune_family(cfg) else
                 f"{cfg.backbone.name}-{cfg.backbone.preset}/{cfg.backbone.patch_size} ({params / 1e6:.2f}M params)")
        self.acc.print(f"{model}, objective={objective_name(cfg)}, "
                       f"routing={recipe(cfg.routing)}, data={cfg.data.name} {tuple(self.dataset.shape)}, "
                       f"{self.acc.num_processes} process(es){' sharded with FSDP' if self.acc.is_fsdp2 else ''} on "
                       f"{self.acc.device}, run_dir={self.run_dir}")
        first = len(self.read_losses)
        budget = t.max_minutes * 60 if t.max_minutes else math.inf
        began = time.perf_counter()
        since = (self.step, began)  # the last read: images/s is measured over the steps after it
        clock = began - self._seconds_logged()  # `seconds` goes on from the log a resumed run continues
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not self.acc.is_main_process, desc="train", dynamic_ncols=True)
        self.in_loop = True
        try:
            with StopSignals() as signals:
                while self.step < t.max_steps:
                    skipped = self.skipped_steps
                    loss = self.train_step()  # None between reads
                    bar.update(1)
                    last = self.step == t.max_steps or time.perf_counter() - began > budget
                    if loss is None and last:
                        loss = self._read()[-1]
                    if loss is None:
                        if signals.agreed(self.acc, reading=False):
                            self._preempt(signals.signum, saved=False)
                        continue
                    now = time.perf_counter()
                    images_per_s = t.batch_size * (self.step - since[0]) / (now - since[1])
                    since = (self.step, now)
                    aligned = {"align": f"{self.last_aux['align']:.4f}"} if "align" in self.last_aux else {}
                    postfix = dict(loss=f"{loss:.4f}", **aligned, img_s=f"{images_per_s:.0f}")
                    bar.set_postfix(postfix)
                    if self.step % t.log_every == 0 or last or self.skipped_steps > skipped:
                        self._write("metrics.jsonl", self.logger.log, self.step, {
                            "loss": loss, **self.last_aux, "images_per_s": images_per_s, "seconds": now - clock,
                            "skipped_steps": self.skipped_steps})
                    self._check_streak()
                    # Save first: a failing preview must not cost the checkpoint of its step. No checkpoint while the
                    # newest step was non-finite: the weights that produced it must not rotate out good ones.
                    saved = bool(t.ckpt_every and (self.step % t.ckpt_every == 0 or last) and not self.bad_streak)
                    if saved:
                        self.save()
                    # A signal ends the run here, before this step's previews and FID (they could outlast the grace time).
                    stop = None if last else signals.agreed(self.acc, reading=True)
                    if stop:
                        self._preempt(stop, saved)
                    drawn = previews and (self.step % previews == 0 or last)
                    if drawn:
                        bar.set_postfix_str(f"drawing the preview grid of step {self.step}")
                        self.sample_grid()
                    scored = cfg.fid.every and (self.step % cfg.fid.every == 0 or last)
                    if scored:
                        bar.set_postfix_str(f"scoring FID at step {self.step}")
                        self.evaluate_fid()
                    if last:
                        break
                    if saved or drawn or scored:  # images_per_s times training steps, not what is done between them
                        resumed = time.perf_counter()
                        since = (self.step, resumed)
                        leave_out(bar, resumed - now)  # ... and so do the bar's s/it and elapsed time
                        bar.set_postfix(postfix)
        finally:
            self.in_loop = False
            bar.close()  # before any message of a stopped run, so it starts a line of its own
        self.logger.close()
        self._release_run_dir()
        return self.read_losses[first:]

    def _seconds_logged(self) -> float:
        """`seconds` of the last line of the log this run continues (0 for a fresh run)."""
        for line, step in reversed(self._metrics):
            seconds = json.loads(line).get("seconds") if step <= self.step else None
            if isinstance(seconds, (int, float)):
                return float(seconds)
        return 0.0

    def _preempt(self, signum: int, saved: bool) -> None:
        """End the run for signal `signum` after this step: its checkpoint (unless written already, or unless the newest
        step was non-finite), then Preempted, whose message is the one line naming it (train/trainer/preemption.py)."""
        self._read()  # the steps since the last read: the guard's counts decide whether this step may be saved
        name, ckpt = StopSignals.name(signum), self.run_dir / "checkpoints" / f"step_{self.step:07d}"
        if self.bad_streak:
            what = f"no checkpoint written, as step {self.step} was non-finite; {self._good_checkpoint('continue from it', lr=False)}"
        else:
            if not saved:
                self.save()
            what = f"saved checkpoint {ckpt}; continue with python -m train run_dir={self.run_dir} resume=auto"
        self.logger.close()
        self._release_run_dir()
        raise Preempted(signum, f"{name} at step {self.step}: {what} (exit code {128 + signum}).")

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

    def _stop_on_write(self, what: str, err: BaseException) -> RunStopped:
        """A write that failed mid-run (a full disk, a folder made read-only): the run stops with exit code 3."""
        full = is_disk_full(err)
        good = self._good_checkpoint("free space, then continue from it" if full else "fix the folder, then continue from it", lr=False)
        self._release_run_dir()
        detail = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
        return RunStopped(f"could not write {what}: {'the disk is full' if full else 'writing failed'} ({detail}); "
                          f"nothing else was changed, and {good}.")

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
                                self.optimizer, self.cfg, keep=self.cfg.trainer.keep_checkpoints, gathered=gathered,
                                align=self._align_state(gathered))
        except NonFiniteWeights as err:
            good = self._good_checkpoint()
            self._release_run_dir()
            raise RunStopped(f"could not save the checkpoint of step {self.step} in {ckpt_root}: the weights hold NaN or inf "
                             f"({err}); {good}.") from None
        except OSError as err:
            raise self._stop_on_write(f"the checkpoint of step {self.step} in {ckpt_root}", err) from None
        self.acc.wait_for_everyone()

    def _gather_checkpoint(self) -> dict:
        """Full state dicts of a sharded run, gathered by every process, kept by the main one: the trained tensors, their
        EMA and AdamW's state (by parameter name), so the checkpoint loads on one process too."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from train.checkpoint import trained_views
        from train.distributed import full_tensors, trained_modules

        net, main = self.acc.unwrap_model(self.net), self.acc.is_main_process
        model = full_tensors(trained_views(net, self.cfg), main)
        with self._ema_net() as ema:
            ema_state = full_tensors(trained_views(ema, self.cfg), main)
        optimizer = get_optimizer_state_dict(trained_modules(net, self.align), self.optimizer.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        align = {} if self.align is None else {"align": full_tensors(self.align.state_dict(), main)}
        return {"model": model, "ema": ema_state, "optimizer": optimizer, **align}

    def _align_state(self, gathered: dict | None) -> dict | None:
        """The projector's full state (align=repa|self) for the checkpoint; None without alignment."""
        if self.align is None:
            return None
        return gathered["align"] if gathered is not None else self.acc.unwrap_model(self.align).state_dict()

    def sample_grid(self) -> Path | None:
        """EMA samples with fixed seed and labels, so grids are comparable across steps."""
        s = self.cfg.sample
        path = self.run_dir / "samples" / f"step_{self.step:07d}.png"
        # A sharded model samples on every process (each forward gathers its weights); the main one writes the grid.
        if self.acc.is_main_process or isinstance(self.ema, ShardedEma):
            # One row per class; a captioned set shows its first captions, or sample.prompts (null label: the empty prompt).
            with self._ema_net() as ema, conditioned_on(ema.model, self.validation) as prompts:
                ema = ema.eval()
                rows = prompts or getattr(self.dataset, "preview_classes", self.dataset.num_classes)
                labels = grid_labels(rows, s.per_class)
                objective = sampling_objective(self.cfg, self.objective, self.backbone, self.dataset.shape)
                x = generate(ema, labels, shape=self.dataset.shape, steps=s.steps, guidance=s.guidance, seed=s.seed,
                             device=self.acc.device, null_label=prompts or self.dataset.num_classes, objective=objective,
                             router=ema.model.router)
            if self.acc.is_main_process:
                path = self._write(f"the sample grid {path.name}", save_grid, self.dataset.to_images(x), path, s.per_class)
        self.acc.wait_for_everyone()
        return path
