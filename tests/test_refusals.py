"""The battery of bad inputs and faults (issue 24): every command refuses each in one sentence with exit code 2,
naming the key or the file, with no traceback, and leaves every byte on disk as it was.

Each case runs in-process, as its command's entry point does (`python -m train` is precompose + Hydra's main),
in a fresh copy of a small sandbox: a trained run, a latents folder, an image folder and a few junk files. The
sandbox is hashed before and after the refusal.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from train.cli import friendly_errors, precompose
from train.data.prompts import random_table, write_table
from train.trainer import Trainer
from conftest import FAST, as_a_command, entry_point
from test_finetune_cli import TABLE_SIZES, write_pretrained

TINY = ["backbone.depth=2", "backbone.hidden_size=32"]  # a model of a few hundred KB, so the sandbox copies fast
RUN = [*FAST, *TINY, "run_dir={box}/run", "resume=auto"]  # continue the sandbox's run
FRESH = [*FAST, *TINY, "run_dir={box}/new"]
LATENTS = [*FAST, *TINY, "data=latents", "data.path={box}/lat", "run_dir={box}/new"]
CKPT = "run/checkpoints/step_0000002"
# REPA with a ViT whose 16-pixel patches at 128 pixels form the digits' 8x8 token grid.
REPA = ["align=repa", "align.encoder=vit_tiny_patch16_224", "align.input_size=128"]


# The sandbox.


def write_latents(folder: Path, labels=(0, 1, 0, 1, 0, 1), label_dtype=np.int64) -> None:
    """A valid latents folder: 6 latents of shape (4, 4, 4), 2 classes, one shard (docs/latents.md)."""
    folder.mkdir()
    mean = np.random.default_rng(0).normal(size=(len(labels), 4, 4, 4)).astype(np.float32)
    save_numpy({"mean": mean, "std": np.full_like(mean, 0.1), "labels": np.array(labels, dtype=label_dtype)},
               folder / "shard-00000.safetensors")
    meta = {"complete": True, "num_classes": 2, "class_names": ["a", "b"], "latent_shape": [4, 4, 4], "scaling_factor": 0.18215,
            "vae": "none", "shards": [{"file": "shard-00000.safetensors", "count": len(labels)}]}
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "stats.json").write_text(json.dumps({"mean": [0.0] * 4, "std": [1.0] * 4}))


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("template")
    # Trained as `python -m train` does, so the run has Hydra's record (.hydra/) that a refusal must not touch.
    run_in_process("train-hydra", [*FAST, *TINY, "trainer.ckpt_every=2", f"run_dir={root / 'run'}"])
    assert (root / "run/.hydra/overrides.yaml").is_file() and (root / CKPT).is_dir()
    write_latents(root / "lat")
    for name in ("a", "b"):
        (root / "imgs" / name).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((8, 8, 3), 40 * i, dtype=np.uint8)).save(root / "imgs" / name / f"{i}.png")
    (root / "junk.bin").write_bytes(bytes(range(256)) * 4)
    (root / "prompts.txt").write_text("a photo of a zero\na photo of a one\n")
    torch.save({}, root / "inception.pth")  # a weights file by its kind; loading it is never reached
    np.savez(root / "small.npz", mu=np.zeros(4), sigma=np.eye(4))
    np.savez(root / "keys.npz", x=np.zeros(3))
    np.save(root / "array.npy", np.zeros(3))
    # A user's YAML config folder (hydra.searchpath), with booleans written as strings.
    (root / "cfg/experiment").mkdir(parents=True)
    (root / "cfg/experiment/quoted_bool.yaml").write_text('# @package _global_\ntrainer:\n  cpu: "true"\n')
    (root / "cfg/experiment/word_bool.yaml").write_text("# @package _global_\ntrainer:\n  ema_warmup: 'off'\n")
    return root


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, Path]:
    """Valid inputs outside the sandbox: a full-size FID reference, a tiny Flux model and prompt tables."""
    root = tmp_path_factory.mktemp("shared")
    np.savez(root / "ref.npz", mu=np.zeros(2048, np.float32), sigma=np.eye(2048, dtype=np.float32))
    flux = write_pretrained("flux", root / "flux")
    sd3 = write_table(random_table("sd3", [f"digit {d}" for d in range(10)], TABLE_SIZES["sd3"]), root / "sd3.safetensors")
    # Another model's weights for REPA's ViT encoder: a ResNet-18's (timm would load the ViT's keys it finds, none).
    import timm

    save_file(timm.create_model("resnet18", pretrained=False, num_classes=0).state_dict(), root / "resnet18.safetensors")
    return {"ref": root / "ref.npz", "flux": flux, "sd3": sd3, "resnet18": root / "resnet18.safetensors"}


# Damage.


def put(path: str, data: str | bytes):
    """Replace the sandbox file `path` with `data`."""
    def prepare(box: Path, _):
        target = box / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data) if isinstance(data, bytes) else target.write_text(data)
    return prepare


def edit_json(path: str, change: Callable[[dict], object]):
    """Change the JSON object in the sandbox file `path` (in place, or `change` returns the new value)."""
    def prepare(box: Path, _):
        obj = json.loads((box / path).read_text())
        new = change(obj)
        (box / path).write_text(json.dumps(obj if new is None else new))
    return prepare


def remove(path: str):
    return lambda box, _: (box / path).unlink()


def truncate(path: str, keep: int = 100):
    return lambda box, _: (box / path).write_bytes((box / path).read_bytes()[:keep])


def flip_last_bytes(path: str):
    def prepare(box: Path, _):
        raw = bytearray((box / path).read_bytes())
        raw[-8:] = b"\xff" * 8
        (box / path).write_bytes(bytes(raw))
    return prepare


def cut_in_half(path: str, kind: str = "safetensors"):
    """A small weights file (safetensors, or torch.save's zip) at `path` in the sandbox, cut in half as a copy that stopped."""
    def prepare(box: Path, _):
        target = box / path
        tensors = {"w": torch.arange(256.0).reshape(16, 16), "b": torch.zeros(16)}
        save_file(tensors, target) if kind == "safetensors" else torch.save(tensors, target)
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    return prepare


def shard(labels=(0, 1, 0, 1, 0, 1), label_dtype=np.int64, count=None):
    """Rewrite the sandbox's latents shard (and meta.json's count) with other labels."""
    def prepare(box: Path, _):
        shutil.rmtree(box / "lat")
        write_latents(box / "lat", labels, label_dtype)
        if count is not None:
            meta = json.loads((box / "lat/meta.json").read_text())
            meta["shards"][0]["count"] = count
            (box / "lat/meta.json").write_text(json.dumps(meta))
    return prepare


def npz(name: str, **arrays):
    return lambda box, _: np.savez(box / name, **arrays)


def hold_lock(box: Path, _):
    """Another trainer holds the run folder's lock."""
    fd = os.open(box / "run/.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return lambda: os.close(fd)


def no_write_permission(path: str):
    """`path` (in the sandbox) is not writable: os.access says so, as it does for anyone but root."""
    def prepare(box: Path, monkeypatch):
        denied, real = os.path.realpath(box / path), os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.path.realpath(p) == denied and mode & os.W_OK
                            else real(p, mode, **kw))
    return prepare


def table(kind: str):
    """A prompt table in the sandbox that is not a usable one for Flux."""
    def prepare(box: Path, _):
        path = box / "table.safetensors"
        if kind == "no_format":
            save_file({"encoder_hidden_states": torch.zeros(11, 4, 24)}, path)
        elif kind == "bad_prompts":
            save_file({"encoder_hidden_states": torch.zeros(11, 4, 24), "pooled_projections": torch.zeros(11, 12)}, path,
                      metadata={"format": "tread-zoo-prompts/1", "family": "flux", "prompts": "[not json"})
        else:
            path.write_bytes(b"\x00" * 64)
    return prepare


# The cases: (id, command, arguments, damage, what the message must name).


@dataclass
class Case:
    id: str
    command: str
    args: list[str]
    prepare: Callable | None = None
    names: str = ""
    code: int = 2
    slow: bool = False


def merged(base: list[str], extra: list[str]) -> list[str]:
    """`base` overrides with `extra` ones replacing those of the same key (Hydra refuses a key given twice)."""
    keys = {arg.split("=", 1)[0].lstrip("+") for arg in extra}
    return [*(arg for arg in base if arg.split("=", 1)[0].lstrip("+") not in keys), *extra]


def T(id, extra, prepare=None, names="", base=RUN, hydra=False, slow=False):
    """A `python -m train` case; `slow`: one more value of a kind the default run already covers (-m slow runs it)."""
    return Case(id, "train-hydra" if hydra else "train", merged(base, extra), prepare, names, slow=slow)


ROUTE = "routing.routes=[{{selection_ratio: {r}, start_layer_idx: {s}, end_layer_idx: {e}}}]"  # .format(r=, s=, e=)
FLUX = [*FAST, "objective=flow", "finetune.family=flux", "finetune.pretrained={flux}", "finetune.prompts={box}/table.safetensors",
        "run_dir={box}/ft"]

BENCH_ONE = ["grid.backbones=[dit]", "grid.routings=[none]", "seeds=[0]"]  # one cell: the grid composes in a second

CASES = [
    # Values Hydra or the model would take in silence or crash on.
    T("ema_warmup_2", ["trainer.ema_warmup=2"], names="trainer.ema_warmup", hydra=True),
    T("ema_warmup_yes", ["trainer.ema_warmup=yes"], names="trainer.ema_warmup", slow=True),
    T("cpu_1", ["trainer.cpu=1"], names="trainer.cpu", slow=True),
    T("overwrite_5", ["overwrite=5"], names="overwrite", slow=True),
    T("betas_three", ["trainer.betas=[0.9,0.999,0.5]"], names="trainer.betas"),
    T("betas_one", ["trainer.betas=[0.9]"], names="trainer.betas"),
    T("betas_none", ["trainer.betas=[]"], names="trainer.betas", slow=True),
    T("betas_one_is_1", ["trainer.betas=[1.0,0.9]"], names="trainer.betas", slow=True),
    T("weight_decay_1e30", ["trainer.weight_decay=1e30"], names="trainer.weight_decay"),
    T("weight_decay_2", ["trainer.weight_decay=2"], names="trainer.weight_decay", slow=True),
    T("max_weight_growth_1", ["trainer.max_weight_growth=1"], names="trainer.max_weight_growth", slow=True),
    T("fp16_on_cpu", ["trainer.mixed_precision=fp16"], names="trainer.mixed_precision"),
    # Combinations that would do nothing in silence: every step skipped as non-finite, graphs never captured.
    T("align_weight_inf", ["align=self", "align.weight=inf"], names="align.weight=inf is not a finite number", base=FRESH),
    T("align_weight_nan", ["align=self", "align.weight=nan"], names="align.weight=nan is not a finite number", base=FRESH, slow=True),
    T("cuda_graphs_without_compile_model", ["trainer.cuda_graphs=true"], names="trainer.compile=off, so no graph would be used"),
    T("cuda_graphs_with_compile_blocks", ["trainer.compile=blocks", "trainer.cuda_graphs=true"], names="trainer.compile=blocks",
      slow=True),
    T("unknown_key", ["trainer.nonsense=1"], names="trainer.nonsense", slow=True),
    T("lr_text", ["trainer.lr=fast"], names="trainer.lr", slow=True),
    T("route_ratio_text", ["routing=random", ROUTE.format(r="abc", s=1, e=1)], names="routing.routes[0].selection_ratio"),
    T("route_index_float", ["routing=random", ROUTE.format(r=0.5, s=0.5, e=1)], names="routing.routes[0].start_layer_idx", slow=True),
    T("route_outside_model", ["routing=random", ROUTE.format(r=0.5, s=0, e=40)], names="routing.routes[0]", hydra=True),
    T("route_ratio_1", ["routing=random", ROUTE.format(r=1.0, s=0, e=1)], names="selection_ratio", slow=True),
    T("route_extra_key", ["routing=random", "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 0, end_layer_idx: 1, foo: 1}]"],
      names="routing.routes[0]"),
    T("policy_kwargs_unknown", ["routing=random", "+routing.policy_kwargs.foo=1"], names="routing.policy_kwargs.foo"),
    T("policy_kwargs_text", ["routing=l1norm", "routing.policy_kwargs.random_mix=abc"], names="routing.policy_kwargs.random_mix"),
    T("preset_data_key_under_other_data", ["+experiment=finetune_wan", "data=latents"], base=LATENTS,
      names="data.frames is a key of data=videos, not of data=latents"),
    T("sprint_with_finetune_preset", ["+experiment=finetune_flux", "routing=sprint"], base=FRESH,  # not structured
      names="routing=sprint trains SPRINT, whose fusion layer the pretrained flux model (finetune.family=flux) does "
            "not have (and the finetune preset's routes replace SPRINT's"),
    T("bench_group", ["bench=quick"], names="configures the benchmark, not a training run; run `python -m train.bench bench=quick`"),
    T("policy_kwargs_without_plus", ["routing=structured", "routing.policy_kwargs={group: 4}"],  # the fix whole, quoted
      names="add it with a plus: '+routing.policy_kwargs={group: 4}'."),
    T("policy_kwargs_range", ["routing=l1norm", "routing.policy_kwargs.random_mix=2"], names="random_mix", slow=True),
    T("mamba_d_state_0", ["backbone=mamba", "+backbone.kwargs.d_state=0"], names="backbone.kwargs.d_state", base=FRESH),
    T("mamba_expand_0", ["backbone=mamba", "+backbone.kwargs.expand=0"], names="backbone.kwargs.expand", base=FRESH, slow=True),
    T("mamba_d_conv_0", ["backbone=mamba", "+backbone.kwargs.d_conv=0"], names="backbone.kwargs.d_conv", base=FRESH, slow=True),
    T("mamba_ssm", ["backbone=mamba", "+backbone.kwargs.ssm=mamba3"], names="backbone.kwargs.ssm", base=FRESH, slow=True),
    T("mamba_scan_order", ["backbone=mamba", "+backbone.kwargs.scan_order=spiral"], names="backbone.kwargs.scan_order", base=FRESH, slow=True),
    T("mamba_headdim", ["backbone=mamba", "+backbone.kwargs.ssm=mamba2", "+backbone.kwargs.headdim=7"], names="headdim", base=FRESH),
    T("diffmoe_no_experts", ["backbone=diffmoe", "+backbone.kwargs.num_experts=0"], names="backbone.kwargs.num_experts", base=FRESH),
    T("diffmoe_capacity_0", ["backbone=diffmoe", "+backbone.kwargs.capacity=0"], names="backbone.kwargs.capacity", base=FRESH, slow=True),
    T("diffmoe_top_k_9", ["backbone=diffmoe", "+backbone.kwargs.top_k=9"], names="backbone.kwargs.top_k", base=FRESH, slow=True),
    T("diffmoe_decay_2", ["backbone=diffmoe", "+backbone.kwargs.threshold_decay=2"], names="backbone.kwargs.threshold_decay", base=FRESH, slow=True),
    T("dit_mlp_ratio_0", ["+backbone.kwargs.mlp_ratio=0"], names="backbone.kwargs.mlp_ratio", base=FRESH, slow=True),
    T("dit_heads_0", ["+backbone.kwargs.num_heads=0"], names="backbone.kwargs.num_heads", base=FRESH, slow=True),
    T("rwkv_width", ["backbone=rwkv", "backbone.hidden_size=30"], names="backbone=rwkv", base=FRESH),
    T("patch_size_3", ["backbone.patch_size=3"], names="backbone.patch_size"),
    T("fashion_missing", ["data=fashion_mnist", "data.path={box}/nowhere"], names="nowhere", base=FRESH, slow=True),
    T("latents_missing", ["data.path={box}/nowhere"], names="data.path", base=LATENTS),
    # REPA's encoder weights (align.weights): damaged, or another model's.
    T("repa_weights_random_bytes", [*REPA, "align.weights={box}/junk.bin"], names="junk.bin' is neither a safetensors nor a PyTorch",
      base=FRESH),
    T("repa_weights_empty", [*REPA, "align.weights={box}/enc.safetensors"], put("enc.safetensors", b""),
      names="enc.safetensors' is empty", base=FRESH),
    T("repa_weights_truncated", [*REPA, "align.weights={box}/enc.safetensors"], cut_in_half("enc.safetensors"),
      names="enc.safetensors' is cut short", base=FRESH),
    T("repa_weights_truncated_pth", [*REPA, "align.weights={box}/enc.pth"], cut_in_half("enc.pth", "torch"),
      names="enc.pth' is not a readable PyTorch weights file", base=FRESH, slow=True),
    T("repa_weights_of_resnet18", [*REPA, "align.weights={resnet18}"], names="does not hold vit_tiny_patch16_224's weights (it lacks",
      base=FRESH),
    # The run folder.
    T("run_dir_empty", ["run_dir="], names="run_dir", hydra=True),
    T("run_dir_is_a_file", ["run_dir={box}/junk.bin"], names="run_dir"),
    T("run_dir_under_a_file", ["run_dir={box}/junk.bin/run"], names="run_dir"),
    T("run_dir_not_writable", [], no_write_permission("run"), names="run_dir"),
    T("checkpoints_not_writable", [], no_write_permission("run/checkpoints"), names="run_dir", slow=True),
    T("parent_not_writable", ["run_dir={box}/new/run"], no_write_permission("."), names="run_dir", slow=True),
    T("run_dir_in_use", [], hold_lock, names="in use by another trainer", hydra=True),
    T("fresh_run_into_a_used_folder", ["resume=null"], names="already holds a run", hydra=True),
    T("resume_true_without_checkpoint", ["resume=true", "run_dir={box}/new"], names="resume=true"),
    T("resume_missing_folder", ["resume={box}/nowhere"], names="resume=", slow=True),
    T("resume_a_file", ["resume={box}/junk.bin"], names="resume=", slow=True),
    T("resume_another_model", ["backbone.depth=3"], names="backbone.depth"),
    # Steps are never undone: a checkpoint past max_steps cannot honour it (a script would read exit 0 as "trained").
    T("resume_past_max_steps", ["trainer.max_steps=1"], names="trainer.max_steps=1", hydra=True),
    # A boolean given as text, on the command line or in a YAML file (OmegaConf converted it in silence).
    T("cpu_quoted_true", ["trainer.cpu='\"true\"'"], names="trainer.cpu"),
    T("yaml_quoted_true", ["hydra.searchpath=[file://{box}/cfg]", "+experiment=quoted_bool"], names="quoted_bool.yaml"),
    # Hydra's own flags skip the early checks (precompose): the job checks the files Hydra loaded.
    T("yaml_quoted_true_config_dir", ["+experiment=quoted_bool"], names="quoted_bool.yaml", base=["--config-dir={box}/cfg", *RUN],
      hydra=True),
    T("yaml_word_no", ["hydra.searchpath=[file://{box}/cfg]", "+experiment=word_bool"], names="trainer.ema_warmup", slow=True),
    T("resume_another_seed", ["seed=1"], names="seed", slow=True),
    # A damaged or hand-edited run.
    T("state_truncated", [], put(f"{CKPT}/state.json", '{"step": '), names="state.json", hydra=True),
    T("state_empty", [], put(f"{CKPT}/state.json", ""), names="state.json", slow=True),
    T("state_binary", [], put(f"{CKPT}/state.json", b"\xff\xfe\x00\x01"), names="state.json", slow=True),
    T("state_a_list", [], put(f"{CKPT}/state.json", "[1, 2]"), names="state.json"),
    T("state_without_step", [], put(f"{CKPT}/state.json", '{"sha256": {}}'), names="step"),
    T("state_step_text", [], put(f"{CKPT}/state.json", '{"step": "two"}'), names="step"),
    T("state_step_negative", [], put(f"{CKPT}/state.json", '{"step": -3}'), names="step", slow=True),
    T("state_sha256_a_list", [], put(f"{CKPT}/state.json", '{"step": 2, "sha256": [1]}'), names="sha256", slow=True),
    T("config_invalid_yaml", [], put(f"{CKPT}/config.yaml", "trainer: [1, 2\n"), names="config.yaml"),
    T("config_a_list", [], put(f"{CKPT}/config.yaml", "- 1\n- 2\n"), names="config.yaml", slow=True),
    T("config_without_sections", [], put(f"{CKPT}/config.yaml", "seed: 0\n"), names="config.yaml"),
    T("latest_empty", [], put("run/checkpoints/latest", ""), names="latest"),
    T("latest_garbage", [], put("run/checkpoints/latest", "hello world"), names="latest"),
    T("latest_binary", [], put("run/checkpoints/latest", b"\xff\x00"), names="latest", slow=True),
    T("metrics_bad_middle_line", [], put("run/metrics.jsonl", 'garbage\n{"step": 2, "loss": 1.0}\n'), names="metrics.jsonl"),
    T("metrics_line_without_step", [], put("run/metrics.jsonl", '{"loss": 1.0}\n{"step": 2}\n'), names="metrics.jsonl", slow=True),
    T("metrics_line_a_list", [], put("run/metrics.jsonl", '[1]\n{"step": 2}\n'), names="metrics.jsonl", slow=True),
    T("metrics_binary", [], put("run/metrics.jsonl", b"\xff\xfe\n"), names="metrics.jsonl", slow=True),
    T("model_truncated", [], truncate(f"{CKPT}/model.safetensors"), names="step_0000002"),
    T("optimizer_garbage", [], put(f"{CKPT}/optimizer.pt", b"garbage" * 10), names="optimizer.pt"),
    T("ema_missing", [], remove(f"{CKPT}/ema.safetensors"), names="ema.safetensors"),
    T("model_bytes_changed", [], flip_last_bytes(f"{CKPT}/model.safetensors"), names="model.safetensors", slow=True),
    # A damaged latents folder.
    T("meta_missing", [], remove("lat/meta.json"), names="meta.json", base=LATENTS),
    T("meta_invalid_json", [], put("lat/meta.json", '{"num_classes": 2,'), names="meta.json", base=LATENTS),
    T("meta_a_list", [], put("lat/meta.json", "[1, 2]"), names="meta.json", base=LATENTS, hydra=True),
    T("meta_align_features_edited", [], edit_json("lat/meta.json", lambda m: m.update(align={"features": {"grid": 5}})),
      names="field 'align.features.grid' is an integer, not a list", base=LATENTS),
    T("meta_without_num_classes", [], edit_json("lat/meta.json", lambda m: m.pop("num_classes") and None), names="num_classes",
      base=LATENTS),
    T("meta_num_classes_text", [], edit_json("lat/meta.json", lambda m: m.update(num_classes="two")), names="num_classes", base=LATENTS),
    T("meta_num_classes_0", [], edit_json("lat/meta.json", lambda m: m.update(num_classes=0, class_names=[])), names="num_classes",
      base=LATENTS, slow=True),
    T("meta_class_names_short", [], edit_json("lat/meta.json", lambda m: m.update(class_names=["a"])), names="class_names",
      base=LATENTS, slow=True),
    T("meta_shape_2d", [], edit_json("lat/meta.json", lambda m: m.update(latent_shape=[4, 4])), names="latent_shape", base=LATENTS, slow=True),
    T("meta_shape_text", [], edit_json("lat/meta.json", lambda m: m.update(latent_shape=["4", "x", 4])), names="latent_shape",
      base=LATENTS, slow=True),
    T("meta_scaling_text", [], edit_json("lat/meta.json", lambda m: m.update(scaling_factor="big")), names="scaling_factor",
      base=LATENTS, slow=True),
    T("meta_scaling_0", [], edit_json("lat/meta.json", lambda m: m.update(scaling_factor=0)), names="scaling_factor", base=LATENTS, slow=True),
    T("meta_without_shards", [], edit_json("lat/meta.json", lambda m: m.pop("shards") and None), names="shards", base=LATENTS),
    T("meta_shards_an_object", [], edit_json("lat/meta.json", lambda m: m.update(shards={})), names="shards", base=LATENTS, slow=True),
    T("meta_shard_without_count", [], edit_json("lat/meta.json", lambda m: m["shards"][0].pop("count") and None),
      names="shards[0].count", base=LATENTS),
    T("meta_shard_count_negative", [], edit_json("lat/meta.json", lambda m: m["shards"][0].update(count=-1)), names="shard 0",
      base=LATENTS, slow=True),
    T("meta_shard_outside", [], edit_json("lat/meta.json", lambda m: m["shards"][0].update(file="../junk.bin")), names="shard 0",
      base=LATENTS, slow=True),
    T("meta_incomplete", [], edit_json("lat/meta.json", lambda m: m.update(complete=False)), names="complete=false", base=LATENTS),
    T("stats_missing", [], remove("lat/stats.json"), names="stats.json", base=LATENTS),
    T("stats_without_std", [], edit_json("lat/stats.json", lambda s: s.pop("std") and None), names="std", base=LATENTS),
    T("stats_fewer_channels", [], edit_json("lat/stats.json", lambda s: s.update(std=[1.0, 1.0])), names="std", base=LATENTS),
    T("stats_std_text", [], edit_json("lat/stats.json", lambda s: s.update(std=["a"] * 4)), names="std", base=LATENTS, slow=True),
    T("stats_zero_std", [], edit_json("lat/stats.json", lambda s: s.update(std=[0.0] * 4)), names="stats.json", base=LATENTS),
    T("stats_nan_std", [], edit_json("lat/stats.json", lambda s: s.update(std=[1.0, float("nan"), 1.0, 1.0])), names="stats.json",
      base=LATENTS),
    T("stats_nan_mean", [], edit_json("lat/stats.json", lambda s: s.update(mean=[float("nan")] * 4)), names="stats.json",
      base=LATENTS, slow=True),
    T("shard_float_labels", [], shard(label_dtype=np.float32), names="labels", base=LATENTS),
    T("shard_labels_outside_classes", [], shard(labels=(0, 1, 0, 1, 0, 7)), names="labels", base=LATENTS),
    T("shard_truncated", [], truncate("lat/shard-00000.safetensors", 200), names="shard-00000", base=LATENTS),
    T("shard_missing", [], remove("lat/shard-00000.safetensors"), names="shard-00000", base=LATENTS, slow=True),
    T("shard_count_differs", [], shard(count=5), names="shard-00000", base=LATENTS, slow=True),
    # FID during training: the reference and the weights are checked at start-up, not after the first samples.
    T("fid_ref_garbage", ["fid.every=2", "fid.ref={box}/junk.bin"], names="junk.bin"),
    T("fid_ref_wrong_size", ["fid.every=2", "fid.ref={box}/small.npz"], names="small.npz"),
    T("fid_ref_one_image", ["fid.every=2", "fid.ref={box}/imgs/a/0.png"], names="0.png", slow=True),
    T("fid_inception_garbage", ["fid.every=2", "fid.ref={ref}", "fid.inception={box}/junk.bin"], names="junk.bin"),
    # Prompt tables of fine-tuning, checked before the pretrained model loads.
    T("table_garbage", [], table("garbage"), names="table.safetensors", base=FLUX),
    T("table_without_format", [], table("no_format"), names="table.safetensors", base=FLUX),
    T("table_bad_prompts", [], table("bad_prompts"), names="table.safetensors", base=FLUX, slow=True),
    T("table_of_sd3", ["finetune.prompts={sd3}"], names="sd3.safetensors", base=FLUX),
    # python -m train.sample
    Case("sample_device_bogus", "sample", ["{box}/run", "--device", "bogus"], names="--device"),
    Case("sample_device_tpu", "sample", ["{box}/run", "--device", "tpu"], names="--device"),
    Case("sample_device_missing_gpu", "sample", ["{box}/run", "--device", "cuda:64"], names="--device"),
    Case("sample_missing_checkpoint", "sample", ["{box}/nowhere"], names="nowhere"),
    Case("sample_state_truncated", "sample", ["{box}/run"], put(f"{CKPT}/state.json", '{"st'), names="state.json"),
    Case("sample_config_invalid", "sample", ["{box}/run"], put(f"{CKPT}/config.yaml", "a: [1"), names="config.yaml"),
    Case("sample_config_without_data_name", "sample", ["{box}/run"],
         lambda box, _: (box / CKPT / "config.yaml").write_text((box / CKPT / "config.yaml").read_text().replace("  name: digits\n", "")),
         names="config.yaml"),
    Case("sample_latest_empty", "sample", ["{box}/run"], put("run/checkpoints/latest", ""), names="latest"),
    Case("sample_per_class_0", "sample", ["{box}/run", "--per-class", "0"], names="--per-class"),
    Case("sample_class_99", "sample", ["{box}/run", "--classes", "99"], names="--classes"),
    Case("sample_steps_0", "sample", ["{box}/run", "--steps", "0"], names="--steps"),
    Case("sample_out_under_a_file", "sample", ["{box}/run", "--out", "{box}/junk.bin/grid.png"], names="--out"),
    Case("sample_out_a_folder", "sample", ["{box}/run", "--out", "{box}/imgs"], names="--out"),
    Case("sample_default_out_not_writable", "sample", ["{box}/run"], no_write_permission(CKPT), names="--out"),
    Case("sample_rg_bad_missing", "sample", ["{box}/run", "--rg-bad", "{box}/nowhere"], names="nowhere"),
    # python -m train.fid
    Case("fid_ref_garbage", "fid", ["--images", "{box}/imgs", "--ref", "{box}/junk.bin"], names="junk.bin"),
    Case("fid_ref_without_mu", "fid", ["--images", "{box}/imgs", "--ref", "{box}/keys.npz"], names="keys.npz"),
    Case("fid_ref_wrong_size", "fid", ["--images", "{box}/imgs", "--ref", "{box}/small.npz"], names="small.npz"),
    Case("fid_ref_nan", "fid", ["--images", "{box}/imgs", "--ref", "{box}/nan.npz"],
         npz("nan.npz", mu=np.full(2048, np.nan, np.float32), sigma=np.eye(2048, dtype=np.float32)), names="nan.npz"),
    Case("fid_ref_inf", "fid", ["--images", "{box}/imgs", "--ref", "{box}/inf.npz"],
         npz("inf.npz", mu=np.zeros(2048, np.float32), sigma=np.full((2048, 2048), np.inf, np.float32)), names="inf.npz"),
    Case("fid_ref_an_npy", "fid", ["--images", "{box}/imgs", "--ref", "{box}/array.npy"], names="array.npy"),
    Case("fid_inception_garbage", "fid", ["--images", "{box}/imgs", "--ref", "{ref}", "--inception", "{box}/junk.bin"],
         names="junk.bin"),
    Case("fid_inception_a_folder", "fid", ["--images", "{box}/imgs", "--ref", "{ref}", "--inception", "{box}/imgs"], names="imgs"),
    Case("fid_inception_empty", "fid", ["--images", "{box}/imgs", "--ref", "{ref}", "--inception", "{box}/empty.pth"],
         put("empty.pth", b""), names="empty.pth"),
    Case("fid_images_missing", "fid", ["--images", "{box}/nowhere", "--ref", "{ref}"], names="--images"),
    Case("fid_save_stats_without_images", "fid", ["--checkpoint", "{box}/run", "--save-stats", "{box}/s.npz"], names="--save-stats"),
    Case("fid_out_under_a_file", "fid", ["--images", "{box}/imgs", "--ref", "{ref}", "--out", "{box}/junk.bin/f.json"], names="--out"),
    Case("fid_num_samples_1", "fid", ["--checkpoint", "{box}/run", "--ref", "{ref}", "--num-samples", "1"], names="--num-samples"),
    Case("fid_checkpoint_state_damaged", "fid",
         ["--checkpoint", "{box}/run", "--ref", "{ref}", "--inception", "{box}/inception.pth", "--num-samples", "2"],
         put(f"{CKPT}/state.json", "{"), names="state.json"),
    # python -m train.cache_latents
    Case("cache_out_is_a_file", "cache", ["--images", "{box}/imgs", "--out", "{box}/junk.bin"], names="--out"),
    Case("cache_out_under_a_file", "cache", ["--images", "{box}/imgs", "--out", "{box}/junk.bin/lat"], names="--out"),
    Case("cache_out_meta_garbage", "cache", ["--images", "{box}/imgs", "--out", "{box}/lat"], put("lat/meta.json", "{"),
         names="meta.json"),
    Case("cache_out_meta_a_list", "cache", ["--images", "{box}/imgs", "--out", "{box}/lat"], put("lat/meta.json", "[]"),
         names="meta.json"),
    Case("cache_out_other_settings", "cache", ["--images", "{box}/imgs", "--out", "{box}/lat"], names="--out"),
    Case("cache_images_missing", "cache", ["--images", "{box}/nowhere", "--out", "{box}/new"], names="--images"),
    Case("cache_images_flat", "cache", ["--images", "{box}/imgs/a", "--out", "{box}/new"], names="--images"),
    Case("cache_labels_binary", "cache", ["--images", "{box}/imgs", "--out", "{box}/new", "--labels-file", "{box}/junk.bin"],
         names="junk.bin"),
    Case("cache_labels_image_missing", "cache", ["--images", "{box}/imgs", "--out", "{box}/new", "--labels-file", "{box}/labels.csv"],
         put("labels.csv", "filename,label\na/0.png,0\na/7.png,1\n"), names="a/7.png"),
    Case("cache_labels_outside", "cache", ["--images", "{box}/imgs", "--out", "{box}/new", "--labels-file", "{box}/labels.csv"],
         put("labels.csv", "a/0.png,0\n../junk.bin,1\n"), names="../junk.bin", slow=True),
    Case("cache_vae_missing", "cache", ["--images", "{box}/imgs", "--out", "{box}/new", "--vae", "{box}/nowhere"], names="nowhere"),
    Case("cache_size_0", "cache", ["--images", "{box}/imgs", "--out", "{box}/new", "--size", "0"], names="--size"),
    # python -m train.encode_prompts
    Case("prompts_device_bogus", "prompts", ["--family", "flux", "--random", "4,24,12", "--prompts", "a", "--out", "{box}/p.st",
                                             "--device", "bogus"], names="--device"),
    Case("prompts_device_missing_gpu", "prompts", ["--family", "flux", "--random", "4,24,12", "--prompts", "a", "--out",
                                                   "{box}/p.st", "--device", "cuda:64"], names="--device"),
    Case("prompts_file_binary", "prompts", ["--family", "flux", "--random", "4,24,12", "--prompts-file", "{box}/junk.bin", "--out",
                                            "{box}/p.st"], names="junk.bin"),
    Case("prompts_file_empty", "prompts", ["--family", "flux", "--random", "4,24,12", "--prompts-file", "{box}/empty.txt", "--out",
                                           "{box}/p.st"], put("empty.txt", "\n\n"), names="prompt"),
    Case("prompts_out_a_folder", "prompts", ["--family", "flux", "--random", "4,24,12", "--prompts", "a", "--out", "{box}/imgs"],
         names="--out"),
    Case("prompts_out_under_a_file", "prompts", ["--family", "flux", "--random", "4,24,12", "--prompts", "a", "--out",
                                                 "{box}/junk.bin/p.st"], names="--out"),
    Case("prompts_random_sizes", "prompts", ["--family", "flux", "--random", "4,24", "--prompts", "a", "--out", "{box}/p.st"],
         names="--random"),
    Case("prompts_pipeline_missing", "prompts", ["--family", "flux", "--pipeline", "{box}/nowhere", "--prompts-file",
                                                 "{box}/prompts.txt", "--out", "{box}/p.st"], names="nowhere"),
    Case("prompts_family_dit", "prompts", ["--family", "dit", "--random", "4,24", "--prompts", "a", "--out", "{box}/p.st"],
         names="--family"),
    # python -m train.bench
    Case("bench_batch_negative", "bench", ["train.batch_size=-4", "out_dir={box}/bench"], names="train.batch_size"),
    Case("bench_batch_text", "bench", ["train.batch_size=many", "out_dir={box}/bench"], names="train.batch_size"),
    Case("bench_device_tpu", "bench", ["device=tpu", "out_dir={box}/bench"], names="device"),
    Case("bench_device_missing_gpu", "bench", ["device=cuda:64", "out_dir={box}/bench"], names="device"),
    Case("bench_unknown_key", "bench", ["bogus=1", "out_dir={box}/bench"], names="bogus"),
    Case("bench_unknown_nested_key", "bench", ["grid.nonsense=1", "out_dir={box}/bench"], names="grid.nonsense"),
    Case("bench_unknown_mode", "bench", ["bench=nonexistent", "out_dir={box}/bench"], names="bench"),
    # Refused inside the job, before its first write: out_dir (here a folder with Hydra's record) keeps every byte.
    Case("bench_unknown_backbone", "bench", ["grid.backbones=[foo]", "out_dir={box}/run"], names="grid.backbones"),
    Case("bench_negative_seed", "bench", ["seeds=[-1]", "out_dir={box}/run"], names="seeds"),
    Case("bench_timing_resolution", "bench", ["timing.resolution=7", "out_dir={box}/run"], names="timing.resolution"),
    Case("bench_speedups_missing", "bench", ["train.speedups_from={box}/nope.json", "out_dir={box}/run"],
         names="train.speedups_from"),
    # The bench's own JSON files, valid JSON of the wrong shape (they ended in an AttributeError): refused before any write.
    Case("bench_cost_a_list", "bench", [*BENCH_ONE, "out_dir={box}/run"], put("run/cost.json", "[1, 2]"), names="cost.json"),
    Case("bench_cost_cells_a_list", "bench", [*BENCH_ONE, "out_dir={box}/run"],
         put("run/cost.json", '{"settings": {"cells": {}}, "cells": ["dit-none"]}'), names="cost.json", slow=True),
    Case("bench_cell_settings_a_list", "bench", [*BENCH_ONE, "out_dir={box}/run"], put("run/cells/dit-none-s0.json", '{"settings": [1]}'),
         names="dit-none-s0.json"),
    Case("bench_speedups_cells_a_list", "bench", [*BENCH_ONE, "train.speedups_from={box}/c.json", "out_dir={box}/run"],
         put("c.json", '{"settings": {"cells": {}}, "cells": ["dit-none"]}'), names="train.speedups_from"),
    Case("bench_speedups_garbage", "bench", ["train.speedups_from={box}/junk.bin", "out_dir={box}/run"],
         names="train.speedups_from"),
]


def snapshot(root: Path) -> dict[str, str]:
    """Every file's SHA-256 and every folder under `root`, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(root.rglob("*"))}


def train_without_hydra(argv: list[str]) -> None:
    """`python -m train` up to Hydra's job: the same composed config goes to the trainer directly (Hydra itself
    composes twice more, which would triple the cost of a case; the `train-hydra` cases go through it)."""
    cfg = precompose("config", argv)
    friendly_errors(lambda: Trainer(cfg).fit())()


MODULES = {"train-hydra": "train", "bench": "train.bench", "sample": "train.sample", "fid": "train.fid",
           "cache": "train.cache_latents", "prompts": "train.encode_prompts"}


def run_in_process(command: str, argv: list[str]) -> None:
    """The command's entry point, as `python -m ...` runs it (it is expected to exit)."""
    with as_a_command([command]):
        (train_without_hydra if command == "train" else entry_point(MODULES[command]))(argv)


def test_the_battery_is_large_and_every_command_is_in_it():
    assert len([c for c in CASES if not c.slow]) >= 100 and len({(c.command, c.id) for c in CASES}) == len(CASES)
    assert {c.command for c in CASES} == {"train", "train-hydra", "sample", "fid", "cache", "prompts", "bench"}


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c.command}-{c.id}", marks=[pytest.mark.slow] if c.slow else []) for c in CASES])
def test_refused_in_one_sentence_and_nothing_on_disk_changes(case, template, shared, tmp_path, monkeypatch, capsys):
    box = tmp_path / "box"
    shutil.copytree(template, box)
    release = case.prepare(box, monkeypatch) if case.prepare else None
    before = snapshot(box)
    places = {"{box}": box, **{f"{{{name}}}": path for name, path in shared.items()}}
    argv = [functools.reduce(lambda a, kv: a.replace(kv[0], str(kv[1])), places.items(), arg) for arg in case.args]
    try:
        with pytest.raises(SystemExit) as exit_:
            run_in_process(case.command, argv)
    finally:
        if callable(release):
            release()
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert exit_.value.code == case.code, out.err
    assert len(errors) == 1 and "Traceback" not in out.err + out.out, out.err
    assert case.names in errors[0], errors[0]
    assert snapshot(box) == before


def test_a_key_given_twice_is_noted_and_the_last_one_used(capsys):
    """Valid for Hydra (the last wins, and scripts that append to a base list of overrides rely on it), so it is not
    refused; but it no longer passes in silence: one note per repeated key names both values and the one used."""
    cfg = precompose("config", [*FAST, *TINY, "trainer.max_steps=3", "trainer.max_steps=5", "routing=random", "routing=rows"])
    out = capsys.readouterr()
    notes = [line for line in out.out.splitlines() if line.startswith("note:")]
    assert "note:" not in out.err
    assert cfg.trainer.max_steps == 5 and cfg.routing.policy == "rows"
    assert any("trainer.max_steps=2, trainer.max_steps=3, trainer.max_steps=5" in n and "the last one, trainer.max_steps=5, is used" in n for n in notes)
    assert any(n.startswith("note: routing is given") for n in notes) and len(notes) == 2  # one per key


def test_under_a_launcher_only_rank_0_prints_the_refusal(monkeypatch, capsys):
    """Every process of `accelerate launch` composes the same config and refuses it before any collective, with the
    same exit code; the sentence is printed once, by rank 0 (docs/training.md: the launcher's own traceback)."""
    for rank, printed in (("1", []), ("0", ["trainer.lr"])):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            precompose("config", [*FAST, "trainer.lr=fast"])
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert exit_.value.code == 2 and len(errors) == len(printed) and all(p in e for p, e in zip(printed, errors))


@pytest.mark.parametrize("text", ['[1, 2]', '{"steps": 8, "per_class": 2, "seed": 0, "rows": {"a": 1}}',
                                  '{"steps": 8, "per_class": 2, "seed": 0, "rows": [1]}', '{"steps": [8], "per_class": 2, "seed": 0, "rows": []}',
                                  '{"steps": 8, "per_class": 2, "seed": 0, "rows": [{"run": "x"}]}'])
def test_a_sampling_table_of_the_wrong_shape_is_refused_naming_it(tmp_path, text):
    """train.bench.sampling pools earlier studies' table.json files: valid JSON that is not one is refused in one
    sentence (a row of another shape ended in a TypeError or KeyError deep in the pooling)."""
    from routing import ConfigError
    from train.bench.sampling import studied

    path = tmp_path / "table.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="table.json is not a table.json written by") as err:
        studied(path)
    assert "\n" not in str(err.value) and path.read_text() == text
