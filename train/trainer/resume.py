"""Resuming: the checkpoint to continue, its weights, AdamW's state and the settings that changed since."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from routing import ConfigError
from train.build import finetune_family
from train.checkpoint import latest_checkpoint, load_checkpoint, load_trained_state
from train.distributed import copy_into_shards, optimizer_from_names, shard_optimizer_state, trained_modules
from train.files import read_state
from train.metrics.alignment import align_name
from train.trainer.changes import Changes, classify, refusal


class Resume:
    """The Trainer's resume."""

    def _resume_path(self) -> Path | None:
        """The checkpoint folder resume= names (None: no resume, or resume=auto|true with no checkpoint yet)."""
        resume = self.cfg.resume
        if not resume:
            return None
        return latest_checkpoint(self.run_dir / "checkpoints") if resume in (True, "auto", "latest") else Path(str(resume))

    def _trained_base(self) -> tuple[str, dict | None] | None:
        """When fine-tuning and resuming: the checkpoint and the base config its state.json records, for build_net to
        compare with finetune.pretrained's before the data is checked against the base (None: nothing to compare; a
        checkpoint that is no checkpoint is refused by _maybe_resume, later)."""
        path = self._resume_path() if finetune_family(self.cfg) else None
        if path is None or not (path / "state.json").is_file():
            return None
        return str(path), read_state(path).pretrained

    def _maybe_resume(self) -> None:
        resume = self.cfg.resume
        if not resume:
            return
        ckpt_root = self.run_dir / "checkpoints"
        path = self._resume_path()
        if path is None:
            if resume == "auto":
                return
            raise ConfigError(f"resume={'true' if resume is True else resume} but {ckpt_root} holds no checkpoint; drop resume= or "
                              "point run_dir= at the run to continue.")
        if not path.is_dir():
            raise ConfigError(f"resume={resume!r} is not a checkpoint folder; pass resume=auto or a step_* folder "
                              f"(e.g. resume={ckpt_root / 'step_0000100'}).")
        state = load_checkpoint(path, self.cfg)
        changes = self._refuse_changes(path, state["config"])  # before any weight is loaded
        self._check_align_state(path, state)
        try:
            load_trained_state(self.acc.unwrap_model(self.net), state, "model", self.cfg)
            with self._ema_net() as ema:
                load_trained_state(ema, state, "ema", self.cfg)
        except RuntimeError as err:
            detail = " ".join(str(err).split())[:400]  # the state-dict keys that did not fit, on one line
            raise ConfigError(f"checkpoint '{path}' does not fit this model ({detail}); resume with the config it was trained with.") from err
        if self.align is not None:  # the projector (align=repa|self); under FSDP into its shards
            align = self.acc.unwrap_model(self.align)
            if self.acc.is_fsdp2:
                copy_into_shards(align.state_dict(), state["align"])
            else:
                align.load_state_dict(state["align"])
        try:
            self._load_optimizer(state)
        except (KeyError, ValueError, TypeError) as err:
            raise ConfigError(f"checkpoint '{path}' holds an optimizer state that does not fit this model ({type(err).__name__}); "
                              "resume from an older step_* folder.") from None
        self._apply_resume_changes(changes)
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        self.acc.print(f"resumed from {path} at step {self.step}")

    def _load_optimizer(self, state: dict) -> None:
        """AdamW's state from a checkpoint, keyed by position (one process, DDP) or by parameter name (FSDP's full state
        dict): either kind resumes either way."""
        # AdamW's order: the network's trained parameters, then the projector's (align.*), its second group.
        joined = trained_modules(self.acc.unwrap_model(self.net), None if self.align is None else self.acc.unwrap_model(self.align))
        trained = [(n, p) for n, p in joined.named_parameters() if p.requires_grad]
        saved = state["optimizer"]
        if state.get("optimizer_keys") == "names":
            saved = optimizer_from_names(saved, [n for n, _ in trained])
        groups = self.optimizer.param_groups
        if len(saved["param_groups"]) == 1 and len(groups) == 2:
            # Aligned runs saved before the projector was AdamW's second group (2026-11-26): split that one group.
            (group,) = saved["param_groups"]
            first = len(groups[0]["params"])
            saved = {**saved, "param_groups": [{**group, "params": group["params"][:first]}, {**group, "params": group["params"][first:]}]}
        if self.acc.is_fsdp2:
            saved = shard_optimizer_state(saved, [p for _, p in trained])
        self.optimizer.load_state_dict(saved)

    def _check_align_state(self, path: Path, state: dict) -> None:
        """A projector saved exactly when this run aligns (AdamW's state holds its moments at fixed positions)."""
        saved, mine = "align" in state, self.align is not None
        if saved != mine:
            was = align_name(state["config"]) if saved else "none"
            raise ConfigError(f"checkpoint '{path}' was trained with align={was}{'' if saved else ' (no projector saved)'}, but this run "
                              f"has align={align_name(self.cfg)}; resume with align={was} or start a new run_dir.")

    def _refuse_changes(self, path: Path, saved_cfg: DictConfig) -> Changes:
        """Every setting that differs from the checkpoint's, classified (changes.py); refused ones stop the run here, in
        one sentence naming each key and the value it was trained with."""
        changes = classify(saved_cfg, self.cfg)
        if changes.refused:
            raise ConfigError(refusal(path, changes.refused))
        return changes

    def _apply_resume_changes(self, changes: Changes) -> None:
        """The allowed changes: AdamW's settings (the state just loaded carries the old ones), then each change said."""
        t = self.cfg.trainer
        for group in self.optimizer.param_groups:
            group.update(lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        for change in changes.warned:
            self.acc.print(f"resume: warning: {change}")
        if changes.applied:
            self.acc.print(f"resume: applying changed settings: {'; '.join(changes.applied)}")
