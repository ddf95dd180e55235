"""Force-keep masks from the data in the trainer (train/data/masks.py, docs/finetuning.md "Masks"): tiny Flux (captions)
and Wan (videos) fine-tunes with `name.mask.png` beside their samples keep every masked token on every route, step after step, and
data.mask_loss_weight weighs the per-element loss as computed by hand, read ahead with the batch or on demand."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from edm import reduce_loss
from routing import ForceKeep
from train.data.prefetch import Prefetcher
from train.trainer import Trainer
from conftest import compose_cfg
from test_captions import overrides, pipeline, write_images  # noqa: F401  (pipeline: the tiny Flux fixture)
from test_videos import tiny, wan  # noqa: F401  (tiny: the tiny Wan pipeline and clips)

MASKED = {"square/a.png": (4, 4, 20, 12), "wide/d.png": (0, 0, 16, 10), "wide/e.png": (30, 18, 48, 32)}  # (l, t, r, b)


def masked_folder(root):
    data = write_images(root)
    for name, box in MASKED.items():
        image = data / name
        with Image.open(image) as im:
            mask = Image.new("L", im.size, 0)
        mask.paste(255, box)
        mask.save(image.with_name(image.stem + ".mask.png"))
    return data


def step_keep(trainer: Trainer) -> torch.Tensor:
    """The force-keep mask of the step about to run (one micro-batch), from the data as the trainer reads it: with its
    host copy (routing.policy.ForceKeep), so the routes size their subsets without reading the device."""
    keep = trainer._load_batch((trainer.step, 0))[3]
    if keep is None:
        return torch.zeros(0, dtype=torch.bool)
    assert isinstance(keep, ForceKeep) and np.array_equal(keep.host, keep.mask.numpy())
    return keep.mask


def test_masked_tokens_are_kept_on_every_route_and_only_with_the_mask(pipeline, tmp_path):  # noqa: F811
    """Over 4 steps (both buckets), every route of every step processes each masked token; the same run without the
    masks' effect (the adapter's held mask ignored) drops some of them, so the check can fail."""
    data = masked_folder(tmp_path / "data")
    kept_all, dropped_without = True, 0
    for forced in (True, False):
        trainer = Trainer(compose_cfg(*overrides(pipeline, data, tmp_path / f"run_{forced}"), "trainer.max_steps=4"))
        adapter = trainer.backbone.adapter
        if not forced:
            trainer._force_kept = lambda keep: adapter.keeping(None)  # the same draws, the mask not passed on
        masked_steps = 0
        for _ in range(4):
            keep = step_keep(trainer)
            trainer.train_step()
            masks = trainer.backbone.router.last_masks  # per route, (B, N) processed tokens
            assert masks and keep.shape == masks[0].shape
            masked_steps += bool(keep.any())
            for processed in masks:
                assert processed.float().mean() < 1  # the route does drop tokens
                if forced:
                    kept_all &= bool((processed | ~keep).all())
                else:
                    dropped_without += int((keep & ~processed).sum())
        trainer._release_run_dir()
        assert masked_steps >= 2  # batches with masks ran
    assert kept_all
    assert dropped_without > 0


def test_mask_loss_weight_weighs_the_loss_as_computed_by_hand(pipeline, tmp_path):  # noqa: F811
    """Step 1 with data.mask_loss_weight=[2, 0.5] equals the mean of the unweighted run's per-element loss (same draws,
    same routes) times 0.5 + 1.5 x the mask's coverage of each latent pixel (1 for an image without a mask)."""
    data = masked_folder(tmp_path / "data")
    seen = {}

    def run(name, *extra, prefetch=False):
        trainer = Trainer(compose_cfg(*overrides(pipeline, data, tmp_path / name), *extra))
        if prefetch:  # the CUDA path: the masks come with the batch, read ahead on the prefetch thread
            trainer.prefetcher = Prefetcher(trainer._load_batch, pin=False)
        loss = trainer.objective.loss

        def record(*args):
            out = loss(*args)
            seen[name] = out.detach()
            return out

        trainer.objective.loss = record
        indices = trainer._global_indices(0)[: trainer.micro_batch]
        value = trainer.train_step()
        trainer._release_run_dir()
        return trainer, indices, value

    trainer, indices, plain = run("plain")
    _, again, weighted = run("weighted", "data.mask_loss_weight=[2.0,0.5]")
    assert run("prefetched", "data.mask_loss_weight=[2.0,0.5]", prefetch=True)[2] == weighted
    assert torch.equal(indices, again)
    masks = trainer.dataset.masks(indices)
    assert masks.present.any()  # the first batch holds a masked image
    by_hand = torch.stack([0.5 + 1.5 * c if p else torch.ones_like(c) for c, p in zip(masks.coverage, masks.present)])  # (b, h, w)
    expected = reduce_loss(seen["plain"] * by_hand[:, None], None)
    assert torch.equal(seen["plain"], seen["weighted"])  # the weight acts after the forward only
    assert weighted == pytest.approx(float(expected), rel=1e-6) and weighted != pytest.approx(plain, rel=1e-3)
    assert np.isfinite(plain)


def test_video_masks_are_kept_on_every_route_of_a_wan_step(tiny, tmp_path):  # noqa: F811
    """data=videos: a clip's mask (every frame) and a frame's mask reach a tiny Wan fine-tune's routes as force-kept
    tokens over (T', h, w), in raster order."""
    folder = tmp_path / "clips"
    shutil.copytree(tiny["clips"], folder, ignore=shutil.ignore_patterns(".tread_cache"))
    corner = Image.new("L", (32, 32), 0)
    corner.paste(255, (0, 0, 8, 8))
    for clip in sorted(folder.glob("clip_*.gif")):
        corner.save(clip.with_name(clip.stem + ".mask.png"))
    trainer = Trainer(compose_cfg(*wan(tiny, f"data.path={folder}", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=2")))
    forced = 0
    for _ in range(2):
        keep = step_keep(trainer)
        trainer.train_step()
        masks = trainer.backbone.router.last_masks
        assert masks and all(m.shape == keep.shape and m.float().mean() < 1 for m in masks)
        assert all((m | ~keep).all() for m in masks)
        forced += int(keep.sum())
    trainer._release_run_dir()
    assert forced > 0
