"""File-system faults mid-run: a disk that fills at any write (checkpoint, sample grid, metrics log, latents
shard), a folder that stops being writable; each stops in one sentence (exit code 3 for a full disk) and leaves
nothing half-written. The metrics log of a resume is replaced in one rename. Faults come from patched writers."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch

import train.checkpoint as checkpoint
import train.data.latent_cache as latent_cache
import train.logger as logger
from train.cli import RunStopped, friendly_errors
from train.trainer import Trainer
from conftest import FAST, compose_cfg
from test_captions import overrides, pipeline, write_images  # noqa: F401  (pipeline: a tiny Flux pipeline, a fixture)

TINY = ["backbone.depth=2", "backbone.hidden_size=32"]


def cfg(run, *overrides):
    return compose_cfg(*FAST, *TINY, f"run_dir={run}", *overrides)


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def stopped(fn, capsys) -> tuple[int, str]:
    """Exit code and the one error line of `fn` run as an entry point (no traceback)."""
    with pytest.raises(SystemExit) as exit_:
        friendly_errors(fn)()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return exit_.value.code, errors[0]


@pytest.mark.parametrize("library", ["torch", "safetensors"])
def test_a_full_disk_at_a_checkpoint_keeps_the_last_good_one(library, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    trainer = Trainer(cfg(run, "trainer.max_steps=4", "trainer.ckpt_every=2"))
    real_save, real_file = torch.save, checkpoint.save_file

    def half_then_full(obj, path, *args, **kwargs):
        # What each library raises when the disk fills mid-file (measured on a full tmpfs).
        Path(path).write_bytes(b"\0" * 10)
        if library == "torch":
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    def at_step_4(save):
        return lambda obj, path, *a, **k: half_then_full(obj, path) if trainer.step == 4 else save(obj, path, *a, **k)

    monkeypatch.setattr(checkpoint.torch if library == "torch" else checkpoint, "save" if library == "torch" else "save_file",
                        at_step_4(real_save if library == "torch" else real_file))
    code, message = stopped(trainer.fit, capsys)
    assert code == 3
    assert "could not write the checkpoint of step 4" in message and f"last good checkpoint is {run / 'checkpoints' / 'step_0000002'}" in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_0000002"]  # no half-written folder


def test_a_full_disk_at_a_sample_grid_leaves_no_cut_png(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    trainer = Trainer(cfg(run, "trainer.max_steps=2", "trainer.sample_every=2"))
    monkeypatch.setattr(os, "fsync", disk_full)  # the grid's temporary file cannot be flushed
    code, message = stopped(trainer.sample_grid, capsys)
    assert code == 3 and "could not write the sample grid step_0000000.png" in message and "the disk is full" in message
    assert not (run / "samples").exists() or not list((run / "samples").iterdir())


class FillsUp:
    """A file whose next write stores half its text, then finds the disk full."""

    def __init__(self, real):
        self.real = real

    def write(self, text):
        self.real.write(text[: len(text) // 2])
        self.real.flush()
        disk_full()

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.real.close()


def test_a_full_disk_at_the_metrics_log_leaves_whole_lines(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    trainer = Trainer(cfg(run, "trainer.max_steps=4"))
    real_open = Path.open

    def opened(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FillsUp(f) if path.name == "metrics.jsonl" and mode == "a" and trainer.step == 3 else f

    monkeypatch.setattr(logger.Path, "open", opened)
    code, message = stopped(trainer.fit, capsys)
    assert code == 3 and "could not write metrics.jsonl" in message
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == [1, 2]


def test_a_folder_made_read_only_mid_run_stops_in_one_sentence(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    trainer = Trainer(cfg(run, "trainer.max_steps=2", "trainer.ckpt_every=2"))
    monkeypatch.setattr(checkpoint, "save_file", lambda *a, **k: (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied")))
    code, message = stopped(trainer.fit, capsys)
    assert code == 3 and "writing failed (Permission denied)" in message and "no checkpoint was written before it" in message
    assert not list((run / "checkpoints").iterdir())


def test_a_full_disk_at_a_latents_shard_leaves_no_shard(tmp_path, monkeypatch, capsys):
    def fills(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 10)
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(latent_cache, "save_file", fills)
    shard = tmp_path / "shard-00000.safetensors"
    code, message = stopped(lambda: latent_cache._write_shard(shard, {"labels": torch.zeros(2, dtype=torch.long)}, {}), capsys)
    assert code == 3 and "shard-00000.safetensors" in message and "the disk is full" in message
    assert list(tmp_path.iterdir()) == []


def test_resume_rewrites_the_metrics_log_in_one_rename(tmp_path, monkeypatch):
    run = tmp_path / "run"
    Trainer(cfg(run, "trainer.max_steps=4", "trainer.ckpt_every=2")).fit()
    full = (run / "metrics.jsonl").read_text()
    # A kill between writing the trimmed log and renaming it over the old one: the old log is whole.
    real_replace = os.replace

    def killed(src, dst):
        if Path(dst).name == "metrics.jsonl":
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg(run, "trainer.max_steps=6", "trainer.ckpt_every=2", "resume=true", "trainer.keep_checkpoints=1",
                    f"resume={run / 'checkpoints' / 'step_0000002'}"))
    monkeypatch.setattr(os, "replace", real_replace)
    assert (run / "metrics.jsonl").read_text() == full and [p.name for p in run.iterdir() if p.name.endswith(".tmp")] == []
    # The next resume trims it to the checkpoint's step.
    Trainer(cfg(run, "trainer.max_steps=6", f"resume={run / 'checkpoints' / 'step_0000002'}"))
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_half_written_last_metrics_line_is_dropped_on_resume(tmp_path):
    run = tmp_path / "run"
    Trainer(cfg(run, "trainer.max_steps=2", "trainer.ckpt_every=2")).fit()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a kill in the middle of an append
    resumed = Trainer(cfg(run, "trainer.max_steps=3", "resume=auto"))
    resumed.fit()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_overwrite_moves_aside_a_run_whose_log_is_damaged(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\ngarbage\n')
    Trainer(cfg(run, "overwrite=true"))
    (old,) = tmp_path.glob("run.old-*")
    assert (old / "metrics.jsonl").read_text() == '{"step": 1}\ngarbage\n' and not (run / "metrics.jsonl").exists()


def test_an_alignment_projector_cut_in_half_is_named_and_the_run_left_as_it_was(tmp_path, capsys):
    """align.safetensors goes through the typed loader as the weights beside it do: one sentence naming it, exit 2."""
    run = tmp_path / "run"
    Trainer(cfg(run, "align=self", "align.projector_width=16", "trainer.ckpt_every=2", "trainer.log_with=none")).fit()
    projector = run / "checkpoints" / "step_0000002" / "align.safetensors"
    projector.write_bytes(projector.read_bytes()[: projector.stat().st_size // 2])
    before = {str(p): p.read_bytes() if p.is_file() else None for p in run.rglob("*")}
    code, message = stopped(lambda: Trainer(cfg(run, "align=self", "align.projector_width=16", "trainer.max_steps=3",
                                                "trainer.log_with=none", "resume=auto")), capsys)
    assert code == 2 and message.startswith(f"error: '{projector}' is cut short or damaged") and "older step_*" in message
    assert {str(p): p.read_bytes() if p.is_file() else None for p in run.rglob("*")} == before


@pytest.mark.parametrize("damage", ["half", "no_info"])
def test_a_damaged_cached_classifier_is_named_not_a_traceback(damage, tmp_path):
    """The benchmark's scoring classifier is a cache: a file cut short, or one without what it was trained on, is one
    sentence saying to delete it (it is then trained again); the file is left for the user to look at."""
    from safetensors.torch import save_file

    from routing import FileError
    from train.metrics.classifier import cache_path, load_or_train

    class Digits:
        name, shape, num_classes = "digits", (1, 16, 16), 10

        def __len__(self):
            return 100

    path = cache_path(tmp_path, Digits())
    save_file({"w": torch.zeros(64, 64)}, path, metadata=None if damage == "no_info" else {"info": "{}"})
    if damage == "half":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = path.read_bytes()
    with pytest.raises(FileError) as err:
        load_or_train(Digits(), None, tmp_path)
    said = "is cut short or damaged" if damage == "half" else "has no readable 'info' metadata"
    assert str(err.value).startswith(f"'{path}' {said}") and str(err.value).endswith("delete it, and the classifier is trained again.")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_caption_cache_file_cut_short_is_named_when_the_dataset_opens(pipeline, tmp_path):
    """The per-bucket latents of data=captions are memory-mapped batch by batch; one cut short is refused when the dataset
    opens (one sentence naming it and how to rewrite it), not at the first batch that reaches its end."""
    from routing import FileError
    from train.data.caption_cache import prepare_captions
    from train.data.captioned import CaptionsDataset

    data = write_images(tmp_path / "data")
    cfg = compose_cfg(*overrides(pipeline, data, tmp_path / "run"))
    folder = prepare_captions(cfg, log=lambda _: None)
    latents = sorted(folder.glob("latents-*.safetensors"))[0]
    latents.write_bytes(latents.read_bytes()[: latents.stat().st_size // 2])
    before = {str(p): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(FileError) as err:
        CaptionsDataset(cfg.data)
    assert str(err.value).startswith(f"'{latents}' is cut short or damaged") and "rewrites the cache" in str(err.value)
    assert "\n" not in str(err.value) and {str(p): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


@pytest.mark.parametrize("name", ["config.json", "diffusion_pytorch_model.safetensors"])
def test_a_pretrained_model_cut_short_is_one_sentence_before_diffusers_reads_it(name, tmp_path, capsys):
    """A download that stopped: the transformer's config or weights cut in half is named (exit 2 in the commands), not
    a JSONDecodeError or diffusers' own error from inside from_pretrained."""
    from backbones.adapters import load_pretrained
    from test_finetune_cli import write_pretrained

    folder = write_pretrained("flux", tmp_path / "flux")
    _cut = folder / name
    _cut.write_bytes(_cut.read_bytes()[: _cut.stat().st_size // 2])
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    code, message = stopped(lambda: load_pretrained("flux", folder), capsys)
    said = "is not valid JSON" if name.endswith(".json") else "is cut short or damaged"
    assert code == 2 and message.startswith(f"error: '{_cut}' {said}") and "fetch the model again" in message
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_pretrained_config_that_does_not_fit_its_weights_is_one_sentence(tmp_path, capsys):
    """config.json from another model than its weights (edited, or fetched apart): diffusers' shape error becomes one
    sentence naming the folder and the fix."""
    from backbones.adapters import load_pretrained
    from test_finetune_cli import write_pretrained

    folder = write_pretrained("flux", tmp_path / "flux")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "joint_attention_dim": config["joint_attention_dim"] + 8}))
    code, message = stopped(lambda: load_pretrained("flux", folder), capsys)
    assert code == 2 and message.startswith(f"error: the weights in '{folder}' do not fit its config.json: context_embedder.weight is [32, 24]")
    assert "fetch config.json and the weights together again" in message and "\n" not in message.strip()


def test_a_pipeline_component_config_cut_short_is_named(pipeline, tmp_path, capsys):
    """A pipeline's VAE config.json cut in half (a download that stopped): the caption cache refuses it in one sentence
    naming the file, before anything is encoded or written."""
    import shutil

    from train.data.caption_cache import prepare_captions

    copy = tmp_path / "pipe"
    shutil.copytree(pipeline, copy)
    config = copy / "vae" / "config.json"
    config.write_bytes(config.read_bytes()[: config.stat().st_size // 2])
    data = write_images(tmp_path / "data")
    cfg = compose_cfg(*overrides(copy, data, tmp_path / "run"))
    before = {str(p) for p in tmp_path.rglob("*")}
    code, message = stopped(lambda: prepare_captions(cfg, log=lambda _: None), capsys)
    assert code == 2 and message.startswith(f"error: '{config}' is not valid JSON") and "fetch the model again" in message
    assert {str(p) for p in tmp_path.rglob("*")} == before


@pytest.mark.parametrize("damage", ["other_weights", "config_half"])
def test_a_timm_encoder_folder_with_other_weights_or_a_cut_config_is_refused(damage, tmp_path):
    """align.weights as a timm folder: weights of another width than its config.json names, or that config cut in half,
    is one sentence naming the file (the folder's encoder is built strictly from them)."""
    import timm
    from safetensors.torch import save_file
    from timm.models import save_for_hf

    from routing import FileError
    from train.metrics.encoder import FrozenEncoder

    small = dict(img_size=32, patch_size=4, depth=1, num_heads=2)
    folder = tmp_path / "encoder"
    save_for_hf(timm.create_model("vit_tiny_patch16_224", pretrained=False, embed_dim=48, **small), str(folder))
    if damage == "other_weights":
        save_file(timm.create_model("vit_tiny_patch16_224", pretrained=False, embed_dim=64, **small).state_dict(),
                  folder / "model.safetensors")
        culprit, says = folder / "model.safetensors", "does not hold the weights of the vit_tiny_patch16_224 that config.json"
    else:
        culprit, says = folder / "config.json", "is not valid JSON"
        culprit.write_bytes(culprit.read_bytes()[: culprit.stat().st_size // 2])
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(FileError) as err:
        FrozenEncoder.load("unused: the folder names it", str(folder), 32, (4, 4))
    assert str(err.value).startswith(f"'{culprit}' {says}") and "\n" not in str(err.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
