"""Latent caching and the latents dataset, offline, with a tiny random VAE and generated images."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors.numpy import load_file

from routing.errors import ConfigError
from train.cache_latents import main as cache_latents
from train.data.images import center_crop_resize
from train.data.latents import build, load_vae

CLASSES = ("cat", "dog", "emu")
PER_CLASS = 4
IMAGE_SIZE = 16


def make_vae(path: Path, **config) -> Path:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        **config,
    )
    vae.save_pretrained(path)
    return path


def make_images(root: Path) -> Path:
    """PNG images of varied sizes in class subfolders, plus one corrupt file."""
    rng = np.random.default_rng(0)
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for i in range(PER_CLASS):
            pixels = rng.integers(0, 256, size=(18 + 3 * i, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    (root / "dog" / "broken.png").write_bytes(b"\x89PNG definitely not an image")
    return root


def cache_args(images: Path, out: Path, vae: Path, *extra: str) -> list[str]:
    return [
        "--images", str(images), "--out", str(out), "--vae", str(vae), "--size", str(IMAGE_SIZE), "--flip",
        "--shard-size", "5", "--batch-size", "3", "--num-workers", "0", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    root = tmp_path_factory.mktemp("latents")
    vae, images, out = make_vae(root / "vae"), make_images(root / "images"), root / "out"
    meta = cache_latents(cache_args(images, out, vae))
    return {"root": root, "vae": vae, "images": images, "out": out, "meta": meta}


def data_cfg(path, normalize="standardize", vae=None):
    return OmegaConf.create({"name": "latents", "path": str(path), "normalize": normalize, "vae": vae})


def test_cache_writes_shards_meta_and_stats(cached):
    out, meta = cached["out"], cached["meta"]
    # 13 files (12 images + 1 corrupt) in shards of 5 source files -> 3 shards; 12 images x 2 flips = 24 latents.
    assert sorted(p.name for p in out.glob("shard-*.safetensors")) == [f"shard-0000{k}.safetensors" for k in range(3)]
    assert not list(out.glob("*.tmp-*"))
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk == meta and meta["complete"]
    assert meta["num_latents"] == 24 and meta["latent_shape"] == [4, 8, 8]
    assert meta["class_names"] == list(CLASSES) and meta["num_classes"] == 3
    assert meta["skipped"] == {"count": 1, "files": ["dog/broken.png"]}
    assert meta["scaling_factor"] == pytest.approx(0.18215)

    shards = [load_file(str(out / shard["file"])) for shard in meta["shards"]]
    assert [len(s["labels"]) for s in shards] == [shard["count"] for shard in meta["shards"]]
    labels = np.concatenate([s["labels"] for s in shards])
    np.testing.assert_array_equal(labels, np.repeat(np.arange(3), 2 * PER_CLASS))
    assert shards[0]["mean"].dtype == np.float16 and shards[0]["std"].min() > 0

    # Flipped copies: the encoder sees the mirrored image, so the two latents of a pair differ.
    assert not np.allclose(shards[0]["mean"][0], shards[0]["mean"][1])

    # stats.json is the per-channel mean/std of scaled posterior samples: s^2 (Var[mean] + E[std^2]).
    mean = np.concatenate([s["mean"] for s in shards]).astype(np.float64)
    std = np.concatenate([s["std"] for s in shards]).astype(np.float64)
    stats = json.loads((out / "stats.json").read_text())
    s = meta["scaling_factor"]
    expected_std = s * np.sqrt(mean.var(axis=(0, 2, 3)) + (std**2).mean(axis=(0, 2, 3)))
    np.testing.assert_allclose(stats["mean"], s * mean.mean(axis=(0, 2, 3)), rtol=1e-9)
    np.testing.assert_allclose(stats["std"], expected_std, rtol=1e-9)


def test_rerun_skips_finished_shards_and_refuses_other_settings(cached, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(cached["out"], out)
    (out / "shard-00001.safetensors").unlink()
    before = {k: (out / f"shard-0000{k}.safetensors").stat().st_mtime_ns for k in (0, 2)}

    meta = cache_latents(cache_args(cached["images"], out, cached["vae"]))
    assert meta == cached["meta"]
    assert {k: (out / f"shard-0000{k}.safetensors").stat().st_mtime_ns for k in (0, 2)} == before
    # The rewritten shard holds the same latents as the first run's.
    redone, original = load_file(str(out / "shard-00001.safetensors")), load_file(str(cached["out"] / "shard-00001.safetensors"))
    np.testing.assert_array_equal(redone["mean"], original["mean"])

    with pytest.raises(ConfigError, match="image_size"):
        cache_latents(cache_args(cached["images"], out, cached["vae"], "--size", "32"))


def test_a_finished_shard_cut_short_is_named_before_the_rerun_writes_anything(cached, tmp_path, capsys):
    """A rerun takes a present shard as finished; one cut short (a copy that stopped) is one sentence naming it, exit 2,
    with meta.json and every shard as they were."""
    from train.cli import friendly_errors

    out = tmp_path / "out"
    shutil.copytree(cached["out"], out)
    shard = out / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as exit_:
        friendly_errors(lambda: cache_latents(cache_args(cached["images"], out, cached["vae"])))()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: '{shard}' is cut short or damaged" in err and "rewrites missing shards" in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1 and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow  # two launched processes, about 17 s on 2 cores (FID's two-process test is slow too)
def test_two_processes_split_the_shards_and_match_one(cached, tmp_path):
    from conftest import ROOT

    out = tmp_path / "out"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29573",
              "-m", "train.cache_latents", *cache_args(cached["images"], out, cached["vae"])]
    result = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "0 of this process's 2 shards already done" in result.stderr  # two processes: shards 0 and 2 on the first
    assert json.loads((out / "meta.json").read_text()) == cached["meta"]
    for k in range(3):
        two, one = load_file(str(out / f"shard-0000{k}.safetensors")), load_file(str(cached["out"] / f"shard-0000{k}.safetensors"))
        np.testing.assert_array_equal(two["labels"], one["labels"])
        np.testing.assert_allclose(two["mean"], one["mean"], atol=1e-3)


def test_flat_folder_with_labels_csv(cached, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    rows = ["filename,label"]
    for i, name in enumerate(("b.png", "a.png", "c.png")):
        Image.fromarray(np.full((20, 20, 3), 60 * i, dtype=np.uint8)).save(flat / name)
        rows.append(f"{name},{'zebra' if i == 1 else 'ant'}")
    (flat / "labels.csv").write_text("\n".join(rows) + "\n")

    meta = cache_latents([
        "--images", str(flat), "--labels-file", str(flat / "labels.csv"), "--out", str(tmp_path / "out"),
        "--vae", str(cached["vae"]), "--size", "16", "--num-workers", "0",
    ])  # fmt: skip
    assert meta["class_names"] == ["ant", "zebra"] and meta["num_latents"] == 3
    # Files are sorted: a.png (zebra), b.png (ant), c.png (ant).
    np.testing.assert_array_equal(load_file(str(tmp_path / "out" / "shard-00000.safetensors"))["labels"], [1, 0, 0])


def test_center_crop_resize_is_square_and_centred():
    # A wide image whose left and right quarters are black: the centre crop keeps only white.
    pixels = np.zeros((40, 80, 3), dtype=np.uint8)
    pixels[:, 20:60] = 255
    image = center_crop_resize(Image.fromarray(pixels), 16)
    assert image.size == (16, 16)
    assert np.asarray(image).min() > 200


def test_get_shapes_dtypes_and_standardisation(cached):
    dataset = build(data_cfg(cached["out"]), sigma_data=0.5)
    assert len(dataset) == 24 and dataset.shape == (4, 8, 8) and dataset.num_classes == 3

    x, labels = dataset.get(torch.tensor([23, 0, 7]), torch.Generator().manual_seed(0))
    assert x.shape == (3, 4, 8, 8) and x.dtype == torch.float32 and labels.dtype == torch.int64
    assert labels.tolist() == [2, 0, 0]
    # Same generator state -> same draw; the posterior noise changes between draws.
    again, _ = dataset.get(torch.tensor([23, 0, 7]), torch.Generator().manual_seed(0))
    other, _ = dataset.get(torch.tensor([23, 0, 7]), torch.Generator().manual_seed(1))
    assert torch.equal(x, again) and not torch.equal(x, other)

    # A copy sent to a worker process reopens its memmaps instead of pickling shard contents.
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._shards == {} and len(pickle.dumps(dataset)) < 10_000
    assert torch.equal(copy.get(torch.tensor([23, 0, 7]), torch.Generator().manual_seed(0))[0], x)

    # Standardised samples have per-channel mean ~0 and std ~sigma_data over the cached set.
    generator = torch.Generator().manual_seed(0)
    draws = torch.cat([dataset.get(torch.arange(len(dataset)), generator)[0] for _ in range(20)])
    per_channel = draws.transpose(0, 1).reshape(4, -1)  # (n, C, h, w) -> (C, n*h*w)
    torch.testing.assert_close(per_channel.std(1), torch.full((4,), 0.5), atol=0.02, rtol=0)
    torch.testing.assert_close(per_channel.mean(1), torch.zeros(4), atol=0.02, rtol=0)

    # normalize=scale is the plain SD scaling of z = mean + std * eps.
    scaled = build(data_cfg(cached["out"], normalize="scale"), sigma_data=0.5)
    shard = load_file(str(cached["out"] / "shard-00000.safetensors"))
    eps = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(3))
    z = torch.from_numpy(shard["mean"][:1]).float() + torch.from_numpy(shard["std"][:1]).float() * eps
    x, _ = scaled.get(torch.tensor([0]), torch.Generator().manual_seed(3))
    torch.testing.assert_close(x, 0.18215 * z)


def test_to_images_decodes_to_unit_range(cached):
    dataset = build(data_cfg(cached["out"]), sigma_data=0.5)
    x, _ = dataset.get(torch.arange(5), torch.Generator().manual_seed(0))
    images = dataset.to_images(x)
    assert images.shape == (5, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert images.min() >= 0 and images.max() <= 1
    # Undoing the standardisation gives back the VAE's own decoding of the unscaled latents.
    vae = load_vae(str(cached["vae"]))
    expected = ((vae.decode(dataset.from_model_space(x)).sample + 1) / 2).clamp(0, 1)
    torch.testing.assert_close(images, expected)


def test_bad_data_path_errors_name_the_key(cached, tmp_path):
    with pytest.raises(ConfigError, match="data.path is not set"):
        build(OmegaConf.create({"name": "latents", "path": "???", "normalize": "standardize"}), 0.5)
    with pytest.raises(ConfigError, match="data.path=.*not a folder"):
        build(data_cfg(tmp_path / "nowhere"), 0.5)
    with pytest.raises(ConfigError, match="data.normalize"):
        build(data_cfg(cached["out"], normalize="whiten"), 0.5)

    broken = tmp_path / "broken"
    shutil.copytree(cached["out"], broken)
    (broken / "shard-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="data.path=.*shard-00002.safetensors is missing"):
        build(data_cfg(broken), 0.5)

    shutil.copy(cached["out"] / "shard-00002.safetensors", broken)
    shard = broken / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="data.path=.*shard-00001.safetensors is corrupt"):
        build(data_cfg(broken), 0.5)


def test_two_training_steps_on_cached_latents(cached, tmp_path):
    from conftest import FAST, compose_cfg
    from train.trainer import Trainer

    run = tmp_path / "run"
    cfg = compose_cfg(*FAST, "data=latents", f"data.path={cached['out']}", "trainer.sample_every=2",
                      "trainer.ckpt_every=2", f"run_dir={run}")
    losses = Trainer(cfg).fit()
    assert len(losses) == 2 and all(np.isfinite(losses))
    grids = list((run / "samples").glob("*.png"))
    assert len(grids) == 1
    with Image.open(grids[0]) as grid:
        # One row per class (3 classes) of decoded 16 x 16 RGB samples.
        assert grid.mode == "RGB" and grid.height >= 3 * IMAGE_SIZE
    assert (run / "checkpoints" / "latest").is_file()


def test_missing_local_vae_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="huggingface-cli download"):
        load_vae(str(tmp_path / "no-such-vae"))


def test_scale_applies_a_shifted_vae_convention_and_decodes_back(cached, tmp_path):
    # Flux's and SD3's VAEs shift as well as scale: their transformers see (z - shift_factor) * scaling_factor.
    vae = make_vae(tmp_path / "vae", scaling_factor=0.3611, shift_factor=0.1159)
    meta = cache_latents(cache_args(cached["images"], tmp_path / "out", vae))
    assert meta["scaling_factor"] == 0.3611 and meta["shift_factor"] == 0.1159
    dataset = build(data_cfg(tmp_path / "out", normalize="scale"), sigma_data=0.5)
    shard = load_file(str(tmp_path / "out" / "shard-00000.safetensors"))
    eps = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(3))
    z = torch.from_numpy(shard["mean"][:1]).float() + torch.from_numpy(shard["std"][:1]).float() * eps
    x, _ = dataset.get(torch.tensor([0]), torch.Generator().manual_seed(3))
    torch.testing.assert_close(x, (z - 0.1159) * 0.3611)
    torch.testing.assert_close(dataset.from_model_space(x), z)  # what the VAE decodes
    # An SD-VAE cache (no shift) reads as before.
    assert build(data_cfg(cached["out"], normalize="scale"), sigma_data=0.5).shift_factor == 0.0


def test_a_folder_that_is_no_vae_is_refused_naming_the_fix(cached, tmp_path, capsys):
    """A transformer's folder ended in a TypeError deep in diffusers, a pipeline's in advice to download the VAE."""
    from train.cli import friendly_errors

    pipeline = tmp_path / "pipeline"
    shutil.copytree(cached["vae"], pipeline / "vae")
    index = {"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"]}
    (pipeline / "model_index.json").write_text(json.dumps(index))
    (pipeline / "transformer").mkdir()
    transformer = {"_class_name": "FluxTransformer2DModel", "patch_size": 1}
    (pipeline / "transformer" / "config.json").write_text(json.dumps(transformer))
    for vae, message in [
        (pipeline / "transformer", "holds a FluxTransformer2DModel, not a diffusers AutoencoderKL; pass a diffusers "
                                   "AutoencoderKL folder"),
        (pipeline, f"holds a diffusers pipeline (model_index.json), not a VAE; pass its VAE subfolder, "
                   f"--vae {pipeline / 'vae'}"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            friendly_errors(cache_latents)(cache_args(cached["images"], tmp_path / "out", vae))
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and "\n" not in err and f"VAE folder '{vae}' {message}" in err, err
    assert not (tmp_path / "out").exists()
    assert load_vae(str(pipeline / "vae")).config.latent_channels == 4  # the fix it names works


@pytest.mark.parametrize("size, nearest", [(15, "--size 12 or --size 16"), (18, "--size 16 or --size 20"),
                                           (9, "--size 8 or --size 12")])
def test_a_size_whose_latents_no_patch_tiles_is_refused_with_the_nearest_ones(cached, tmp_path, size, nearest):
    # The tiny VAE halves each side (factor 2) and every model's patch is at least 2: sizes are multiples of 4.
    with pytest.raises(ConfigError) as err:
        cache_latents(cache_args(cached["images"], tmp_path / "out", cached["vae"], "--size", str(size)))
    assert str(err.value) == (f"--size {size} is not a multiple of 4 (the VAE's factor 2 x the smallest patch 2), so "
                              f"its latents would not split into a model's patches; use {nearest}.")
    assert not (tmp_path / "out").exists()
