"""data=videos and +experiment=finetune_wan on the CPU: a tiny random WanPipeline and the moving-shapes fixture, both
written offline (docs/figures/finetune_tiny_wan.py); captions through its umT5, clips through its AutoencoderKLWan."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from routing import ConfigError
from train.trainer import Trainer
from conftest import ROOT, compose_cfg, run_cli

TINY = ["data.frames=5", "data.height=32", "data.width=32", "data.max_sequence_length=8", "finetune.dtype=fp32",
        "finetune.gradient_checkpointing=false", "finetune.lora.rank=4", "trainer.mixed_precision=no", "trainer.cpu=true",
        "trainer.batch_size=4", "trainer.log_every=1", "trainer.log_with=none", "trainer.sample_every=0", "trainer.ckpt_every=0",
        "sample.steps=2", "sample.per_class=1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-wan")
    script = runpy.run_path(str(ROOT / "docs" / "figures" / "finetune_tiny_wan.py"))
    script["main"](["--pipeline", str(root / "pipeline"), "--clips", str(root / "clips"), "--num-clips", "6", "--frames", "5",
                    "--size", "32"])
    return {"pipeline": root / "pipeline", "clips": root / "clips", "root": root}


def wan(tiny, *extra: str) -> list[str]:
    return ["+experiment=finetune_wan", f"finetune.pretrained={tiny['pipeline']}", f"data.path={tiny['clips']}", *TINY, *extra]


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_finetune_wan_trains_on_captioned_clips_and_writes_video_samples(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(compose_cfg(*wan(tiny, "trainer.max_steps=2", "trainer.sample_every=2", "trainer.ckpt_every=2", f"run_dir={run}"))).fit()
    assert "data=videos (4, 2, 4, 4)" in capsys.readouterr().out  # 4 latent channels, 1 + (5 - 1) / 4 latent frames of 4 x 4
    sample = Image.open(run / "samples" / "step_0000002.gif")
    assert sample.n_frames == 5  # the VAE decodes the 2 latent frames back to 5
    ckpt = run / "checkpoints" / "step_0000002"
    assert all(".lora_" in k for k in load_file(ckpt / "model.safetensors"))
    assert (ckpt / "lora" / "pytorch_lora_weights.safetensors").is_file()

    # train.sample writes an animated grid, GIF or MP4, from the EMA weights; --prompt encodes new captions.
    from train.sample import main as sample

    out = sample([str(run), "--steps", "2", "--per-class", "1", "--out", str(tmp_path / "s.mp4")])
    import imageio_ffmpeg

    assert out.suffix == ".mp4" and imageio_ffmpeg.count_frames_and_secs(str(out))[0] == 5
    out = sample([str(run), "--steps", "2", "--per-class", "2", "--prompt", "a blue disk moving up"])
    assert out.suffix == ".gif" and Image.open(out).n_frames == 5
    # --size sets the frame size (the clips' frame count stays); the preset previews at CFG 5, which a line says.
    capsys.readouterr()
    out = sample([str(run), "--steps", "2", "--per-class", "1", "--size", "48x16", "--out", str(tmp_path / "wide.gif")])
    with Image.open(out) as grid:
        # 4 preview captions, a 48x16 clip each, 1 px padding
        assert grid.n_frames == 5 and grid.size == (48 + 2, 4 * 16 + 5)
    assert "note: guidance 1.0 (this run's previews use 5.0: --guidance 5 for those)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        sample([str(run), "--steps", "2", "--size", "40x40", "--out", str(tmp_path / "odd.gif")])
    assert exit_.value.code == 2 and not (tmp_path / "odd.gif").exists()
    assert capsys.readouterr().err.strip() == ("error: --size 40x40 is not a multiple of 16 on each side (the VAE's "
                                               "factor 8 x the model's patch 2); use --size 48x48.")


def test_resume_continues_a_video_run_exactly_and_reuses_the_cache(tiny, tmp_path):
    common = wan(tiny, "finetune.lora.dropout=0.1", "routing=structured",
                 "routing.routes=[{selection_ratio: 0.75, start_layer_idx: 1, end_layer_idx: 2}]")
    trainer = Trainer(compose_cfg(*common, "trainer.max_steps=4", "trainer.ckpt_every=4", f"run_dir={tmp_path / 'straight'}"))
    trainer.fit()
    written = (tiny["clips"] / ".tread_cache" / "manifest.json").stat()
    (mask,) = trainer.backbone.route_masks()
    assert mask.shape[1:] == (2, 2, 2) and (mask.sum((1, 2, 3)) == 2).all()  # 2 latent frames: 1 x 2 x 2 groups keep 1
    Trainer(compose_cfg(*common, "trainer.max_steps=2", "trainer.ckpt_every=2", f"run_dir={tmp_path / 'split'}")).fit()
    Trainer(compose_cfg(*common, "trainer.max_steps=4", "trainer.ckpt_every=4", f"run_dir={tmp_path / 'split'}", "resume=true")).fit()
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")
    a, b = (load_file(tmp_path / r / "checkpoints" / "step_0000004" / "ema.safetensors") for r in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    cache = tiny["clips"] / ".tread_cache"
    assert json.loads((cache / "manifest.json").read_text())["captions"][0].startswith("a ")
    again = (cache / "manifest.json").stat()  # two runs later, the same file: the manifest is written only when it changes
    assert (again.st_ino, again.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)


def test_clips_are_read_from_gifs_frame_folders_and_mp4s(tiny, tmp_path):
    from train.data.videos import clip_array, list_clips
    from train.grid import save_grid

    folder = tmp_path / "clips"
    shutil.copytree(tiny["clips"], folder, ignore=shutil.ignore_patterns(".tread_cache"))
    video = torch.rand(1, 3, 7, 32, 32)
    save_grid(video, folder / "extra.mp4", per_row=1)
    (folder / "extra.txt").write_text("a green square moving down\n")
    clips = {c.file: c for c in list_clips(folder, frames=5, stride=1)}
    assert {"clip_000.gif", "clip_003", "extra.mp4"} <= set(clips)  # GIF, frame folder, MP4
    assert clips["clip_003"].frames == 5 and clips["extra.mp4"].frames == 7 and clips["extra.mp4"].size == (64, 64)  # save_grid shows small frames at 64 px
    array = clip_array(folder / "clip_003", 5, 1, 32, 32)
    assert array.shape == (3, 5, 32, 32) and -1 <= array.min() and array.max() <= 1
    frames = [np.asarray(Image.open(f).convert("RGB"), dtype=np.float32) / 127.5 - 1 for f in sorted((folder / "clip_003").iterdir())]
    np.testing.assert_allclose(array.transpose(1, 2, 3, 0), np.stack(frames), atol=1e-6)  # same size: no resampling


@pytest.mark.parametrize("change, extra, message", [
    ("short", [], "has 3 frames, but a sample takes 5 (data.frames=5, data.stride=1)"),
    ("caption", [], "has no caption file; write its caption to"),
    ("empty", [], "is empty; write the clip's caption into it"),
    ("broken", [], "is unreadable (UnidentifiedImageError); replace or delete it."),
    (None, ["data.frames=4"], "data.frames=4 is not 1 + 4k, the frame counts the VAE encodes"),
    (None, ["data.height=40"], "data.height=40 is not a multiple of 16 (the VAE's factor 8 x the model's patch 2)"),
    ("patch", [], "gives 1 latent frames, which the model's temporal patch 2 does not divide"),
    ("sizes", [], "has frames of different sizes ('000.png' is 32x32, '002.png' is 40x32); resize its frames to one size"),
    ("mask_size", [], "is 16x16 but its image"),
    ("mask_mode", [], "has mode RGB; save it as a greyscale (L) or 1-bit PNG"),
    ("mask_orphan", [], "has no image beside it"),
    (None, ["data.vae=pixels"], "data.vae=pixels gives RGB frames, but the model in finetune.pretrained="),
])
def test_bad_clips_and_sample_shapes_are_refused_in_one_sentence_before_any_work(tiny, tmp_path, change, extra, message):
    folder, pipeline = tmp_path / "clips", tmp_path / "pipeline"
    shutil.copytree(tiny["clips"], folder, ignore=shutil.ignore_patterns(".tread_cache"))
    shutil.copytree(tiny["pipeline"], pipeline)
    if change == "short":
        frames = [Image.new("RGB", (32, 32), (i * 60, 0, 0)) for i in range(3)]
        frames[0].save(folder / "clip_000.gif", save_all=True, append_images=frames[1:])
    elif change == "caption":
        (folder / "clip_001.txt").unlink()
    elif change == "empty":
        (folder / "clip_001.txt").write_text("  \n")
    elif change == "broken":
        (folder / "clip_002.gif").write_bytes(b"GIF89a but not really")
    elif change == "patch":
        config = json.loads((pipeline / "transformer" / "config.json").read_text())
        (pipeline / "transformer" / "config.json").write_text(json.dumps({**config, "patch_size": [2, 2, 2]}))
        extra = ["data.frames=1"]
    elif change == "sizes":
        frames = sorted((folder / "clip_003").iterdir())
        Image.open(frames[2]).resize((40, 32)).save(frames[2])
    elif change == "mask_size":
        Image.new("L", (16, 16)).save(folder / "clip_000.mask.png")
    elif change == "mask_mode":
        Image.new("RGB", (32, 32)).save(folder / "clip_003" / "001.mask.png")
    elif change == "mask_orphan":
        Image.new("L", (32, 32)).save(folder / "clip_003" / "0042.mask.png")
    run, before = tmp_path / "run", snapshot(folder)
    with pytest.raises(ConfigError) as err:
        Trainer(compose_cfg(*wan(tiny, *extra), f"finetune.pretrained={pipeline}", f"data.path={folder}", f"run_dir={run}"))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not run.exists() and snapshot(folder) == before  # nothing was written, not even the cache


def snapshot(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_clip_and_frame_masks_come_with_the_batch_per_latent_frame(tiny, tmp_path):
    """`name.mask.png` beside a clip masks every frame; `0002.mask.png` in a frame folder masks that frame, so only the
    latent frame holding it (Wan: frames 1-4 -> latent frame 1) is covered."""
    from train.data.masks import mask_inputs

    folder = tmp_path / "clips"
    shutil.copytree(tiny["clips"], folder, ignore=shutil.ignore_patterns(".tread_cache"))
    corner = Image.new("L", (32, 32), 0)
    corner.paste(255, (0, 0, 8, 8))
    corner.save(folder / "clip_000.mask.png")
    corner.save(folder / "clip_003" / f"{sorted((folder / 'clip_003').iterdir())[2].stem}.mask.png")
    trainer = Trainer(compose_cfg(*wan(tiny, f"data.path={folder}", f"run_dir={tmp_path / 'run'}", "data.mask_loss_weight=[1.0,0.0]")))
    ds = trainer.dataset
    index = {f: i for i, f in enumerate(ds.manifest["files"])}
    batch = torch.tensor([index["clip_000.gif"], index["clip_003"], index["clip_001.gif"]])
    masks = ds.masks(batch)
    assert masks.coverage.shape == (3, *ds.shape[1:]) and masks.present.tolist() == [True, True, False]  # (B, T', h, w)
    assert masks.coverage[0, :, 0, 0].eq(1).all() and masks.coverage[1, 0].max() == 0 and masks.coverage[1, 1, 0, 0] == 1
    keep, weight = mask_inputs(ds, batch, (1, 2, 2), ds.mask_loss_weight)  # Wan's patch over (T', h, w)
    t, h, w = ds.shape[1:]
    assert keep.shape == (3, t * (h // 2) * (w // 2)) and keep[0].sum() == t and keep[1].sum() == 1 and not keep[2].any()
    assert weight.shape == (3, 1, t, h, w) and weight[2].eq(1).all() and weight[0].min() == 0
    trainer._release_run_dir()


def test_a_refusal_is_one_line_on_stderr_and_exit_code_2(tiny, tmp_path, capsys):
    from train.cli import friendly_errors

    with pytest.raises(SystemExit) as exit_:
        friendly_errors(lambda: Trainer(compose_cfg(*wan(tiny, "data.frames=6", f"run_dir={tmp_path / 'run'}"))))()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: data.frames=6 is not 1 + 4k") and "\n" not in err
    with pytest.raises(ConfigError, match="finetune.family=wan trains on video clips, not data=digits"):
        Trainer(compose_cfg("objective=flow", "finetune.family=wan", f"finetune.pretrained={tiny['pipeline']}", *TINY[4:],
                            f"run_dir={tmp_path / 'run2'}"))


def test_a_video_cache_cut_short_is_named_when_the_dataset_opens(tiny, tmp_path):
    """The cached clip latents cut in half (a kill mid-copy, a full disk elsewhere): one sentence naming the file."""
    from routing import FileError
    from train.data.video_cache import LATENTS, VideosDataset, prepare_videos
    from train.data.videos import check_videos

    folder = tmp_path / "clips"
    shutil.copytree(tiny["clips"], folder, ignore=shutil.ignore_patterns(".tread_cache"))
    cfg = compose_cfg(*wan(tiny, f"data.path={folder}", f"run_dir={tmp_path / 'run'}"))
    cache = prepare_videos(cfg, check_videos(cfg), log=lambda _: None)
    (cache / LATENTS).write_bytes((cache / LATENTS).read_bytes()[: (cache / LATENTS).stat().st_size // 2])
    with pytest.raises(FileError) as err:
        VideosDataset(cfg.data)
    assert str(err.value).startswith(f"'{cache / LATENTS}' is cut short or damaged") and "rewrites the cache" in str(err.value)


@pytest.mark.slow
def test_python_m_train_runs_the_wan_preset_on_the_fixture_and_refuses_with_exit_code_2(tiny, tmp_path):
    run = tmp_path / "run"
    result = run_cli("train", *wan(tiny, "trainer.max_steps=2", "trainer.sample_every=2", f"run_dir={run}"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert Image.open(run / "samples" / "step_0000002.gif").n_frames == 5
    result = run_cli("train", *wan(tiny, "data.frames=6", f"run_dir={tmp_path / 'bad'}"))
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0
