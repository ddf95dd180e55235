"""Representation alignment wired into the trainer (docs/alignment.md): align=none trains exactly as before, REPA and
self-alignment train through `python -m train` on every family and recipe, the projector is saved beside the model
(never in it, its EMA or what load_run gives) and resumes exactly, and the step reads nothing on the host between
logging steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict
from safetensors.torch import load_file

from backbones import FAMILIES, family_module
from routing import ConfigError
from train.checkpoint import load_run
from train.trainer import Trainer

from conftest import FAST, compose_cfg, run_cli
from test_align import vit_folder as tiny_vit_folder  # noqa: F401  (a fixture)
from host_reads import HostReads
from test_host_sync import while_recorded

# The matrix's tiny model: depth 6 (the recipes' routes r2->-4 and r2->-3), width 32, an 8x8 token grid on digits.
TINY = ["backbone.depth=6", "backbone.hidden_size=32", "trainer.log_with=none", "align.projector_width=16"]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def tread(family: str) -> str:
    """TREAD's policy for a family: rows for the scan families (they need a grid), random for the others."""
    return "rows" if family_module(family).Block.needs_grid else "random"


@pytest.fixture(scope="module")
def vit_folder(tiny_vit_folder):
    """test_align's random tiny ViT as a timm folder (patch 4 at 32 pixels: an 8x8 grid, the tiny model's on digits)."""
    return tiny_vit_folder[1]


def mode_args(mode: str, folder: Path) -> list[str]:
    return ["align=self"] if mode == "self" else ["align=repa", f"align.weights={folder}", "align.input_size=32"]


# align=none


def test_alignment_off_trains_exactly_as_before(tmp_path):
    """align=none, a config without the align key (runs before it existed) and align=self at weight 0 (the projector
    and the EMA teacher run, adding 0) give the same losses bit for bit: the teacher's draws are a stream of their own."""
    common = [*FAST, *TINY, "trainer.max_steps=3", "routing=random", "trainer.grad_clip=1.0"]
    none = Trainer(compose_cfg(*common, f"run_dir={tmp_path / 'none'}")).fit()
    absent_cfg = compose_cfg(*common, f"run_dir={tmp_path / 'absent'}")
    with open_dict(absent_cfg):
        del absent_cfg["align"]
    absent = Trainer(absent_cfg).fit()
    zero = Trainer(compose_cfg(*common, "align=self", "align.weight=0", f"run_dir={tmp_path / 'zero'}")).fit()
    weighted = Trainer(compose_cfg(*common, "align=self", f"run_dir={tmp_path / 'self'}")).fit()
    assert none == absent == zero
    assert weighted[0] == none[0] and weighted[1:] != none[1:]  # the same first step; alignment changes the updates after it
    assert "align" not in metrics(tmp_path / "none")[-1] and "align" in metrics(tmp_path / "zero")[-1]


@pytest.mark.parametrize("weight, said", [("0", True), ("0.04", False)])
def test_alignment_at_weight_zero_is_named_in_one_line(tmp_path, capsys, weight, said):
    """align.weight=0 with align on runs the teacher and the projector for nothing: one line says so (not refused, since
    it is the control above); any other weight says nothing."""
    trainer = Trainer(compose_cfg(*FAST, *TINY, "align=self", f"align.weight={weight}", f"run_dir={tmp_path / 'run'}"))
    trainer._release_run_dir()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("align.weight=")]
    assert lines == ([f"align.weight=0: align=self runs every step (the EMA teacher's forward and the projector) but adds nothing to "
                      "the loss, so nothing is aligned; set align=none to skip that work, or a weight above 0 to align."] if said else [])


# Two steps through `python -m train`


def _two_steps(tmp_path: Path, family: str, recipe: str, mode: str, folder: Path, *extra: str) -> None:
    run = tmp_path / "run"
    out = run_cli("train", *FAST, *TINY, f"backbone={family}", f"routing={recipe}", *mode_args(mode, folder),
                  "trainer.ckpt_every=2", f"run_dir={run}", *extra)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = metrics(run)
    assert [line["step"] for line in lines] == [1, 2]
    assert all(torch.isfinite(torch.tensor([line["loss"], line["align"]])).all() for line in lines)
    ckpt = run / "checkpoints" / "step_0000002"
    projector = load_file(ckpt / "align.safetensors")
    assert projector and all(k.startswith("projector.") for k in projector)
    for name in ("model.safetensors", "ema.safetensors"):
        assert not any("projector" in k for k in load_file(ckpt / name)), name


@pytest.mark.parametrize("mode", ["self", "repa"])
def test_alignment_trains_two_steps_through_the_cli(tmp_path, vit_folder, mode):
    _two_steps(tmp_path, "dit", "random", mode, vit_folder)


@pytest.mark.parametrize("mode", ["self", "repa"])
def test_alignment_trains_under_the_flow_objective(tmp_path, vit_folder, mode):
    """Rectified flow: the EMA teacher's lower noise level is flow time t - gap * u (teacher_time)."""
    _two_steps(tmp_path, "dit", "sprint", mode, vit_folder, "objective=flow")


MATRIX = [(f, r, m) for f in FAMILIES for r in ("none", "tread", "sprint") for m in ("repa", "self")]


@pytest.mark.slow
@pytest.mark.parametrize("family,recipe,mode", MATRIX)
def test_every_family_and_recipe_trains_with_alignment(tmp_path, vit_folder, family, recipe, mode):
    _two_steps(tmp_path, family, tread(family) if recipe == "tread" else recipe, mode, vit_folder)


# Checkpoints, resume, exports


def test_a_checkpoint_with_the_projector_in_the_models_adam_group_resumes_exactly(tmp_path):
    """Aligned checkpoints written before the projector became AdamW's second group (one group for both) resume, and
    continue exactly as an uninterrupted run."""
    common = [*FAST, *TINY, "routing=random", "align=self", "trainer.ckpt_every=2"]
    Trainer(compose_cfg(*common, "trainer.max_steps=3", f"run_dir={tmp_path / 'straight'}")).fit()
    Trainer(compose_cfg(*common, "trainer.max_steps=2", f"run_dir={tmp_path / 'old'}")).fit()
    path = tmp_path / "old" / "checkpoints" / "step_0000002" / "optimizer.pt"
    saved = torch.load(path, weights_only=False)
    model, projector = saved["optimizer"]["param_groups"]
    saved["optimizer"]["param_groups"] = [{**model, "params": model["params"] + projector["params"]}]  # the old layout
    torch.save(saved, path)
    state = json.loads((path.parent / "state.json").read_text())
    state["sha256"].pop("optimizer.pt")  # rewritten on purpose: no digest to check
    (path.parent / "state.json").write_text(json.dumps(state))
    Trainer(compose_cfg(*common, "trainer.max_steps=3", f"run_dir={tmp_path / 'old'}", "resume=true")).fit()
    (last,), (want,) = metrics(tmp_path / "old")[-1:], metrics(tmp_path / "straight")[-1:]
    assert (last["step"], last["loss"], last["align"]) == (want["step"], want["loss"], want["align"])


def test_alignment_resumes_exactly_and_stays_out_of_the_model(tmp_path):
    """4 steps straight equal 2 steps, then a resume to 4 (losses, alignment losses, projector); the checkpoint's model
    and EMA hold exactly the tensors of an align=none run, and load_run gives a model without the projector."""
    common = [*FAST, *TINY, "routing=random", "align=self", "trainer.ckpt_every=2"]
    Trainer(compose_cfg(*common, "trainer.max_steps=4", f"run_dir={tmp_path / 'straight'}")).fit()
    Trainer(compose_cfg(*common, "trainer.max_steps=2", f"run_dir={tmp_path / 'resumed'}")).fit()
    resumed = Trainer(compose_cfg(*common, "trainer.max_steps=4", f"run_dir={tmp_path / 'resumed'}", "resume=true"))
    assert resumed.step == 2
    resumed.fit()
    straight, again = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [(m["step"], m["loss"], m["align"]) for m in straight] == [(m["step"], m["loss"], m["align"]) for m in again]
    a = load_file(tmp_path / "straight" / "checkpoints" / "step_0000004" / "align.safetensors")
    b = load_file(tmp_path / "resumed" / "checkpoints" / "step_0000004" / "align.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    Trainer(compose_cfg(*FAST, *TINY, "routing=random", "trainer.ckpt_every=2", f"run_dir={tmp_path / 'none'}")).fit()
    for name in ("model.safetensors", "ema.safetensors"):
        plain = load_file(tmp_path / "none" / "checkpoints" / "step_0000002" / name)
        aligned = load_file(tmp_path / "resumed" / "checkpoints" / "step_0000002" / name)
        assert plain.keys() == aligned.keys(), name
    loaded = load_run(tmp_path / "straight")
    assert not any("projector" in k for k in loaded.net.state_dict())

    # Resuming an aligned run without alignment is refused in one sentence (as any change of align's keys), and so is
    # aligning a run saved before the align key existed (its checkpoint holds no projector), before any weight loads.
    # Only the mode is named: align=none's other keys build nothing.
    with pytest.raises(ConfigError, match=r"cannot change on resume \(align.name: 'self' -> 'none'\)"):
        Trainer(compose_cfg(*FAST, *TINY, "routing=random", "trainer.max_steps=4", f"run_dir={tmp_path / 'straight'}", "resume=true"))
    saved = tmp_path / "none" / "checkpoints" / "step_0000002" / "config.yaml"
    old = OmegaConf.load(saved)
    del old["align"]
    OmegaConf.save(old, saved)
    with pytest.raises(ConfigError, match=r"was trained with align=none \(no projector saved\), but this run has align=self; resume "
                                          r"with align=none or start a new run_dir\.$") as err:
        Trainer(compose_cfg(*common, "trainer.max_steps=4", f"run_dir={tmp_path / 'none'}", "resume=true"))
    assert "\n" not in str(err.value)


# No host read between logging steps


@pytest.mark.parametrize("extra", [["align.teacher=ema"], ["align.teacher=online", "align.teacher_layer=-1"]], ids=["ema", "online"])
def test_alignment_reads_nothing_on_the_host_between_logging_steps(tmp_path, extra):
    run = tmp_path / "run"
    trainer = Trainer(compose_cfg(*FAST, *TINY, "routing=random", "align=self", *extra, "trainer.max_steps=3",
                                  "trainer.log_every=3", f"run_dir={run}"))
    with HostReads(armed=False) as reads:
        steps = while_recorded(trainer, reads)
        losses = trainer.fit()
    assert steps == [1, 2, 3] and len(losses) == 3 and not reads.reads, reads.summary()
    assert [m["step"] for m in metrics(run)] == [3] and "align" in metrics(run)[0]


# trainer.compile


@pytest.mark.slow
def test_alignment_under_whole_model_compile_matches_eager(tmp_path):
    common = [*FAST, *TINY, "routing=random", "align=self", "trainer.max_steps=2"]
    eager = Trainer(compose_cfg(*common, f"run_dir={tmp_path / 'eager'}")).fit()
    compiled = Trainer(compose_cfg(*common, "trainer.compile=model", f"run_dir={tmp_path / 'compiled'}")).fit()
    assert compiled == pytest.approx(eager, rel=1e-4)
    ours, theirs = metrics(tmp_path / "compiled"), metrics(tmp_path / "eager")
    assert [m["align"] for m in ours] == pytest.approx([m["align"] for m in theirs], rel=1e-4)


# DDP


@pytest.mark.slow
def test_two_processes_align_as_one(tmp_path):
    """Two gloo processes (DDP: the projector's gradients all-reduced) give one process's losses and alignment losses."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    args = [*FAST, *TINY, "routing=random", "align=self", "trainer.max_steps=3", "trainer.batch_size=8"]
    one = run_cli("train", *args, f"run_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-2000:]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29563", "-m", "train", *args,
              f"run_dir={tmp_path / 'two'}"]
    two = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["align"] == pytest.approx(x["align"], rel=1e-5)
