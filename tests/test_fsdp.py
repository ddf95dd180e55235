"""trainer.distributed=fsdp: accelerate's FSDP2 over 2 CPU processes (gloo) equals one process with the same global
batch; checkpoints are full state dicts that resume across process counts and kinds (one process <-> FSDP).

    python -m pytest tests/test_fsdp.py       # the 2-process test CI runs (about 30 s on 2 cores)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from routing import ConfigError
from train.trainer import Trainer
from conftest import FAST, ROOT, compose_cfg

ARGS = [*FAST, "trainer.batch_size=8", "trainer.ckpt_every=2", "trainer.keep_checkpoints=5", "trainer.grad_clip=1.0",
        "trainer.log_with=none"]
ROUTED = [*ARGS, "routing=random"]


def losses(run: Path) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def tensors(run: Path, step: int, name: str) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step:07d}" / f"{name}.safetensors")


def assert_close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < tol


def launch_fsdp(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29573", "-m", "train",
               "trainer.distributed=fsdp", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def one_then_fsdp(tmp_path: Path, args: list[str], *fsdp_args: str) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """One process trains 5 steps, the reference (checkpoints at 2 and 4); FSDP on 2 processes resumes its checkpoint of
    step 2 (positional AdamW state) and trains to step 4. Returns both run folders and the FSDP launch."""
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    Trainer(compose_cfg(*args, "trainer.max_steps=5", f"run_dir={one}")).fit()
    (sharded / "checkpoints").mkdir(parents=True)
    shutil.copytree(one / "checkpoints" / "step_0000002", sharded / "checkpoints" / "step_0000002")
    (sharded / "checkpoints" / "latest").write_text("step_0000002")
    result = launch_fsdp(*args, "trainer.max_steps=4", *fsdp_args, f"run_dir={sharded}", "resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    return one, sharded, result


def test_fsdp_on_two_processes_equals_one_process_and_checkpoints_resume_across_them(tmp_path):
    # With a route on: a sample's route is drawn from (seed, step, its index), so the split into processes changes
    # nothing, and the bound docs/finetuning_fsdp.md states (losses relative 1e-5, weights and EMA 1e-5) holds routed.
    one, sharded, result = one_then_fsdp(tmp_path, ROUTED, "trainer.sample_every=4")
    assert "2 process(es) sharded with FSDP" in result.stdout and "resumed from" in result.stdout
    for step in (3, 4):
        assert losses(sharded)[step] == pytest.approx(losses(one)[step], rel=1e-5)
    # Saved whole (not shards), equal to the one-process run's: weights, EMA, and AdamW's state by parameter name.
    for name in ("model", "ema"):
        assert_close(tensors(sharded, 4, name), tensors(one, 4, name))
    saved = torch.load(sharded / "checkpoints" / "step_0000004" / "optimizer.pt", weights_only=False)
    assert saved["optimizer_keys"] == "names" and "model.blocks.0.attn.qkv.weight" in saved["optimizer"]["state"]
    assert (sharded / "samples" / "step_0000004.png").is_file()  # the EMA preview, sampled by both processes

    # One process resumes the FSDP checkpoint and takes step 5 as the one-process run did.
    Trainer(compose_cfg(*ROUTED, "trainer.max_steps=5", f"run_dir={sharded}", "resume=true")).fit()
    assert losses(sharded)[5] == pytest.approx(losses(one)[5], rel=1e-5)
    assert_close(tensors(sharded, 4, "model"), tensors(one, 4, "model"))


def test_fsdp_with_one_process_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(ConfigError) as err:
        Trainer(compose_cfg(*ARGS, "trainer.distributed=fsdp", f"run_dir={tmp_path / 'run'}"))
    assert "trainer.distributed=fsdp shards the model over processes, but this run has one" in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("backbone", ["dit", "diffmoe"])
def test_gradient_checkpointing_recomputes_every_block_with_equal_gradients(backbone):
    from train.build import build_backbone_for

    grads, thresholds = [], []
    for checkpointing in (False, True):
        cfg = compose_cfg(f"backbone={backbone}", "routing=random", f"trainer.gradient_checkpointing={str(checkpointing).lower()}")
        torch.manual_seed(0)
        model = build_backbone_for(cfg, (1, 16, 16), 10).train()
        assert model.router.checkpointing == checkpointing
        model.router.generator = torch.Generator().manual_seed(1)
        g = torch.Generator().manual_seed(2)
        out = model(torch.randn(4, 1, 16, 16, generator=g), torch.randn(4, generator=g), torch.arange(4))
        out.square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        thresholds.append([b.clone() for n, b in model.named_buffers() if n.endswith("threshold_updates")])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name])
    # DiffMoE's capacity thresholds count each batch once, not again in the recompute.
    assert all(torch.equal(a, b) for a, b in zip(*thresholds)) and all(int(t) == 1 for t in thresholds[1])


@pytest.mark.slow
def test_fsdp_fine_tunes_wan_with_lora_and_gathers_an_adapter_only_checkpoint_equal_to_one_process(tmp_path):
    """Wan (frozen base sharded with its LoRA, gradient checkpointing on) on pixels, where a sample has no posterior
    noise, so one process and two see the same batch: equal losses, LoRA, EMA and the lora/ export."""
    import runpy

    runpy.run_path(str(ROOT / "docs" / "figures" / "finetune_tiny_wan.py"))["main"](
        ["--pipeline", str(tmp_path / "pipe"), "--clips", str(tmp_path / "clips"), "--num-clips", "4", "--frames", "5", "--size", "32",
         "--pixels"])
    wan = ["+experiment=finetune_wan", f"finetune.pretrained={tmp_path / 'pipe'}", f"data.path={tmp_path / 'clips'}", "data.vae=pixels",
           "data.frames=5", "data.height=32", "data.width=32", "data.max_sequence_length=8", "finetune.dtype=fp32",
           "finetune.gradient_checkpointing=false", "finetune.lora.rank=4", "trainer.mixed_precision=no", *ARGS, "trainer.batch_size=4",
           "trainer.max_steps=2", "routing.routes=[]"]
    Trainer(compose_cfg(*wan, f"run_dir={tmp_path / 'one'}")).fit()
    result = launch_fsdp(*wan, "trainer.gradient_checkpointing=true", f"run_dir={tmp_path / 'fsdp'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    for name in ("model", "ema", "lora/pytorch_lora_weights"):
        one, two = tensors(tmp_path / "one", 2, name), tensors(tmp_path / "fsdp", 2, name)
        assert all(".lora_" in k for k in two)
        assert_close(two, one)


@pytest.mark.slow
@pytest.mark.parametrize("teacher", [["align.teacher=online", "align.teacher_layer=-1"], ["align.teacher=ema"]], ids=["online", "ema"])
def test_fsdp_with_alignment_equals_one_process_and_resumes_across_them(tmp_path, teacher):
    """align=self under FSDP: the projector is sharded beside the blocks (AdamW's second group), the EMA teacher runs a
    sharded copy loaded with the EMA's shards, and two processes resumed from one process's step 2 give its losses,
    alignment losses, projector and AdamW state; one process then resumes the FSDP checkpoint (about 1 min on 2 cores)."""
    aligned = [*ROUTED, "align=self", *teacher, "align.projector_width=16"]
    one, sharded, _ = one_then_fsdp(tmp_path, aligned)
    logged = {name: {line["step"]: line for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
              for name, run in (("one", one), ("fsdp", sharded))}
    for step in (3, 4):
        for key in ("loss", "align"):
            assert logged["fsdp"][step][key] == pytest.approx(logged["one"][step][key], rel=1e-5)
    for name in ("model", "align"):
        assert_close(tensors(sharded, 4, name), tensors(one, 4, name))
    saved = torch.load(sharded / "checkpoints" / "step_0000004" / "optimizer.pt", weights_only=False)
    assert saved["optimizer_keys"] == "names" and "align.projector.0.weight" in saved["optimizer"]["state"]
    Trainer(compose_cfg(*aligned, "trainer.max_steps=5", f"run_dir={sharded}", "resume=true")).fit()
    assert losses(sharded)[5] == pytest.approx(losses(one)[5], rel=1e-5)
