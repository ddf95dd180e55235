"""REPA on cached latents (docs/alignment.md): `train.cache_latents --align-images / --align-encoder` stores the images
or the encoder's patch features beside each latent, and align=repa on data=latents reads them, with a tiny random VAE
and test_align's tiny random ViT (patch 4 at 32 pixels: an 8x8 grid, pooled 2x2 onto the latents' 4x4 token grid)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors.numpy import load_file

from routing.errors import ConfigError
from train.cache_latents import main as cache_latents
from train.data.prefetch import Prefetcher
from train.data.images import center_crop_resize
from train.metrics.encoder import CachedFeatures, FrozenEncoder
from train.trainer import Trainer

from conftest import FAST, compose_cfg, run_cli
from test_align import vit_folder as tiny_vit_folder  # noqa: F401  (a fixture)
from test_latents import CLASSES, IMAGE_SIZE, cache_args, make_images, make_vae

ENCODER = "vit_tiny_patch16_224"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_vit_folder):
    """A VAE, an image folder, and its latents cached with the images at 32 pixels and the ViT's features."""
    root = tmp_path_factory.mktemp("align-latents")
    vae, images, vit = make_vae(root / "vae"), make_images(root / "images"), tiny_vit_folder[1]
    meta = cache_latents(cache_args(images, root / "both", vae, "--align-images", "32", "--align-encoder", ENCODER,
                                    "--align-weights", str(vit), "--align-input-size", "32"))
    return {"root": root, "vae": vae, "images": images, "vit": vit, "both": root / "both", "meta": meta}


def pixels_of(path) -> torch.Tensor:
    """The cache's view of one source image: centre-cropped to IMAGE_SIZE, (1, 3, S, S) in [-1, 1]."""
    with Image.open(path) as image:
        array = np.asarray(center_crop_resize(image.convert("RGB"), IMAGE_SIZE)).copy()
    return torch.from_numpy(array).permute(2, 0, 1)[None].float() / 127.5 - 1  # (S, S, 3) -> (1, 3, S, S)


def test_the_cache_stores_images_and_features_row_by_row(folders):
    meta, vit = folders["meta"], folders["vit"]
    assert meta["align"] == {"images": 32, "features": {"encoder": ENCODER, "weights": str(vit.resolve()), "input_size": 32,
                                                        "grid": [8, 8], "dim": 48}}
    assert json.loads((folders["both"] / "meta.json").read_text())["align"] == meta["align"]
    shard = load_file(str(folders["both"] / meta["shards"][0]["file"]))
    n = len(shard["labels"])
    assert shard["align_images"].shape == (n, 3, 32, 32) and shard["align_images"].dtype == np.uint8
    assert shard["align_features"].shape == (n, 64, 48) and shard["align_features"].dtype == np.float16
    # Row 0 is the first image, row 1 its mirror (--flip): the features are the encoder's on exactly those pixels.
    encoder = FrozenEncoder.load(ENCODER, str(vit), 32, None, dtype=torch.float32)
    pixels = pixels_of(folders["images"] / CLASSES[0] / "0.png")
    for row, seen in ((0, pixels), (1, pixels.flip(-1))):
        want = encoder(seen)[0].numpy()
        got = shard["align_features"][row].astype(np.float32)
        assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()  # fp16 storage, bf16 autocast when caching
    assert np.abs(shard["align_images"][1].astype(int) - shard["align_images"][0][..., ::-1].astype(int)).max() <= 1


def test_resuming_with_other_align_settings_is_refused(folders, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(folders["both"], out)
    args = cache_args(folders["images"], out, folders["vae"], "--align-images", "64")
    with pytest.raises(ConfigError, match=r"holds latents cached with align=\{'images': 32, 'features'"):
        cache_latents(args)


def test_cached_features_pool_onto_the_token_grid():
    features = torch.randn(2, 64, 5)  # (B, 8*8, C) in raster order
    pooled = CachedFeatures((8, 8), 5, (4, 4), 32)(features)
    by_hand = features.reshape(2, 4, 2, 4, 2, 5).mean(dim=(2, 4)).reshape(2, 16, 5)  # 2x2 patches per token
    torch.testing.assert_close(pooled, by_hand)
    with pytest.raises(ConfigError, match="the cached features .* have a 8x8 patch grid, which does not pool onto the model's 3x3"):
        CachedFeatures((8, 8), 5, (3, 3), 32)


@pytest.mark.parametrize("source", ["features", "images"])
def test_repa_trains_on_cached_latents(folders, tmp_path, source):
    """With features cached, no encoder is loaded (align.weights may be absent); with images only, the encoder runs on them."""
    folder = folders["both"]
    if source == "images":  # the same folder without the features
        folder = tmp_path / "images-only"
        shutil.copytree(folders["both"], folder)
        meta = json.loads((folder / "meta.json").read_text())
        meta["align"] = {"images": 32}
        (folder / "meta.json").write_text(json.dumps(meta))
    weights = [f"align.weights={folders['vit']}"] if source == "images" else []
    cfg = compose_cfg(*FAST, "data=latents", f"data.path={folder}", "align=repa", f"align.encoder={ENCODER}", "align.input_size=32",
                      *weights, "backbone.hidden_size=32", "align.projector_width=16", f"run_dir={tmp_path / 'run'}")
    trainer = Trainer(cfg)
    assert trainer.align.source == source
    assert (trainer.align.targets.__class__ is CachedFeatures) == (source == "features")
    losses = trainer.fit()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert all(np.isfinite(r["align"]) and r["align"] != 0 for r in logged if "align" in r)
    # What REPA reads comes with the batch, so the CUDA path's prefetch thread reads it ahead: the same losses.
    again = Trainer(OmegaConf.merge(cfg, {"run_dir": str(tmp_path / "prefetched")}))
    again.prefetcher = Prefetcher(again._load_batch, pin=False)
    assert again.fit() == pytest.approx(losses, rel=0, abs=0)


def test_repa_on_latents_without_what_it_needs_is_one_sentence(folders, tmp_path):
    plain = tmp_path / "plain"
    cache_latents(cache_args(folders["images"], plain, folders["vae"]))
    common = [*FAST, "data=latents", "align=repa", f"align.encoder={ENCODER}", "align.input_size=32", f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"^align=repa encodes the clean images, but this latents folder holds neither them nor"):
        Trainer(compose_cfg(*common, f"data.path={plain}"))
    with pytest.raises(ConfigError, match=r"data.path holds vit_tiny_patch16_224 features at 32 pixels, but align.encoder=vit_small"):
        Trainer(compose_cfg(*common, f"data.path={folders['both']}", "align.encoder=vit_small_patch16_224"))


def test_an_encoder_without_its_weights_is_one_sentence(folders, tmp_path):
    out = run_cli("train.cache_latents", *cache_args(folders["images"], tmp_path / "out", folders["vae"], "--align-encoder", ENCODER))
    assert out.returncode == 2 and not (tmp_path / "out").exists()
    assert out.stderr.strip().splitlines() == ["error: python -m train.cache_latents: --align-encoder and --align-weights go together: "
                                               "name the timm encoder and its local weights file; see python -m train.cache_latents --help."]
