"""Force-keep masks from the data (train/data/masks.py): `name.mask.png` beside an image, clip or frame is read,
checked, fitted as its sample is, pooled to the token grid, and its tokens are never routed by any policy."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from routing import ConfigError
from routing.policy import POLICIES, build_policy
from train.data.buckets import fit_to_bucket
from train.data.captions import list_captioned
from train.data.masks import BatchMasks, clip_coverage, fit_coverage, force_keep, loss_weight, mask_file, pool, read_mask
from test_captions import write_images


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def save_mask(path: Path, size: tuple[int, int], box: tuple[int, int, int, int], mode: str = "L") -> Path:
    """A mask of `size` (width, height), white inside `box` (left, top, right, bottom)."""
    mask = Image.new(mode, size, 0)
    mask.paste(255 if mode == "L" else 1, box)
    mask.save(path)
    return path


def test_a_mask_is_fitted_as_its_image_is_and_pooled_to_tokens(tmp_path):
    # A 300x100 image into a 64x32 bucket: scaled by 0.32 to 96x32 and cropped to its centre (16 px cut each side).
    path = save_mask(tmp_path / "a.mask.png", (300, 100), (150, 0, 300, 50))  # the top-right quarter
    coverage = fit_coverage(read_mask(path), (64, 32))
    image = np.asarray(fit_to_bucket(read_mask(path).convert("RGB"), (64, 32)))[..., 0]  # the image's own geometry
    assert coverage.shape == (32, 64) and 0 <= coverage.min() and coverage.max() == 1
    assert ((image > 127) <= (coverage > 0)).all() and ((coverage == 1) <= (image > 127)).all()
    assert coverage[:, :32].max() == 0 and coverage[20:].max() == 0  # left half and lower part: no coverage at all
    latent = pool(coverage, 2)  # (16, 32) at a VAE factor 2
    keep = force_keep(BatchMasks(torch.from_numpy(latent)[None], torch.tensor([True])), 2)  # tokens of 2x2 latent pixels
    grid = keep.view(8, 16)  # (1, 128) -> (h, w) raster
    assert keep.shape == (1, 128) and grid[:, :8].sum() == 0 and grid[:3, 8:].all() and not grid[6:].any()


def test_one_masked_pixel_keeps_exactly_its_token_in_raster_order():
    cov = torch.zeros(2, 8, 8)
    cov[0, 5, 2] = 0.01  # token (2, 1) of a 4x4 grid of 2x2 patches
    keep = force_keep(BatchMasks(cov, torch.tensor([True, False])), 2)
    assert keep.shape == (2, 16) and keep[0].nonzero().flatten().tolist() == [2 * 4 + 1] and not keep[1].any()
    video = torch.zeros(1, 2, 4, 4)  # (B, T', h, w) with patch (1, 2, 2): tokens (2, 2, 2)
    video[0, 1, 3, 0] = 1
    assert force_keep(BatchMasks(video, torch.tensor([True])), (1, 2, 2)).nonzero()[:, 1].tolist() == [1 * 4 + 1 * 2 + 0]


def test_the_loss_weight_applies_inside_and_outside_and_is_one_without_a_mask():
    cov = torch.tensor([[[1.0, 0.5], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])  # (B, h, w)
    weight = loss_weight(BatchMasks(cov, torch.tensor([True, False])), [2.0, 0.0])
    assert weight.shape == (2, 1, 2, 2)
    assert weight[0, 0].tolist() == [[2.0, 1.0], [0.0, 0.0]] and weight[1].eq(1).all()


def test_a_clip_mask_covers_every_latent_frame_that_holds_a_masked_frame():
    masks = [None, None, Image.new("L", (16, 16), 255), None, None]  # frame 2 of 5: Wan's latent frame 1 (frames 1..4)
    cov = clip_coverage(masks, (16, 16), temporal=4, spatial=8)
    assert cov.shape == (2, 2, 2) and cov[0].max() == 0 and cov[1].min() == 1


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_masked_tokens_are_never_routed_by_any_policy_over_many_draws(tmp_path, policy, ratio):
    """The masks of real files (two images of a batch, one without a mask), pooled to an 8x8 token grid, passed to
    every policy as force_keep: over 200 draws each, no masked token is ever left out of a route."""
    first = save_mask(tmp_path / "a.mask.png", (64, 64), (8, 40, 30, 60))
    second = save_mask(tmp_path / "b.mask.png", (64, 64), (40, 0, 64, 12))
    coverage = np.stack([pool(fit_coverage(read_mask(p), (32, 32)), 2) for p in (first, second)] + [np.zeros((16, 16), np.float32)])
    keep = force_keep(BatchMasks(torch.from_numpy(coverage), torch.tensor([True, True, False])), 2)  # (3, 64)
    assert keep[0].sum() >= 6 and keep[1].sum() >= 6 and not keep[2].any()
    chooser = build_policy(policy)
    x = torch.randn(3, 64, 8)
    for draw in range(200):
        generator = torch.Generator().manual_seed(draw)
        chosen = chooser.select(x + 0.1 * torch.randn(x.shape, generator=generator), (8, 8), ratio, generator, force_keep=keep)
        processed = torch.zeros_like(keep).scatter(1, chosen.indices, True)  # (B, K) indices -> (B, N) membership
        assert (processed | ~keep).all(), f"{policy} at ratio {ratio} routed a masked token (draw {draw})"


@pytest.mark.parametrize("problem, message", [
    ("size", "is 20x32 but its image"),
    ("mode", "has mode RGB; save it as a greyscale (L) or 1-bit PNG"),
    ("broken", "is unreadable"),
    ("orphan", "has no image beside it"),
])
def test_a_bad_mask_is_refused_in_one_sentence_and_nothing_changes(tmp_path, problem, message):
    data = write_images(tmp_path / "data")
    save_mask(data / "square" / "a.mask.png", (32, 32), (0, 0, 16, 16))  # a good one beside a 32x32 image
    bad = data / "square" / "b.mask.png"
    if problem == "size":
        save_mask(bad, (20, 32), (0, 0, 4, 4))
    elif problem == "mode":
        Image.new("RGB", (32, 32)).save(bad)
    elif problem == "broken":
        bad.write_bytes(b"\x89PNG but not one")
    else:
        save_mask(data / "square" / "z.mask.png", (32, 32), (0, 0, 4, 4))
    before = snapshot(data)
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        list_captioned(data)
    assert "\n" not in str(err.value) and ".mask.png" in str(err.value)
    assert snapshot(data) == before


def test_masks_are_not_images_and_one_bit_masks_are_accepted(tmp_path):
    data = write_images(tmp_path / "data")
    save_mask(data / "wide" / "d.mask.png", (48, 32), (0, 0, 8, 8), mode="1")
    items = list_captioned(data)
    assert len(items) == 6 and not any("mask" in item.file for item in items)  # no caption needed for a mask
    assert mask_file(data / "wide" / "d.png") == data / "wide" / "d.mask.png"


@pytest.mark.parametrize("weights, box, says", [
    ("[1.0,0.0]", (0, 0, 0, 0), "is all black, and data.mask_loss_weight=[1.0, 0.0] weighs outside the region 0"),
    ("[0.0,1.0]", (0, 0, 48, 32), "is all white, and data.mask_loss_weight=[0.0, 1.0] weighs inside the region 0"),
    ("[1.0,0.0]", (0, 0, 8, 8), None),
], ids=["empty-mask-outside-0", "full-mask-inside-0", "a-region"])
def test_a_mask_that_weighs_its_whole_sample_0_is_refused(weights, box, says, tmp_path, capsys):
    """SimpleTuner's masked loss [1, 0] with an empty mask (or [0, 1] with a full one) trains nothing on that image: refused
    in one sentence naming the mask, exit 2, before anything is written into the data folder."""
    from conftest import compose_cfg
    from train.cli import friendly_errors
    from train.data.captions import check_captions

    data = write_images(tmp_path / "data")
    mask = save_mask(data / "wide" / "d.mask.png", (48, 32), box)
    cfg = compose_cfg("data=captions", f"data.path={data}", "finetune.family=flux", "run_dir=/tmp/unused",
                      f"data.mask_loss_weight={weights}")
    before = snapshot(data)
    if says is None:
        assert len(check_captions(cfg)) == len(list_captioned(data)) and snapshot(data) == before
        return
    with pytest.raises(SystemExit) as exit_:
        friendly_errors(lambda: check_captions(cfg))()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: mask '{mask}' {says}"), err
    assert f"so '{data / 'wide' / 'd.png'}' would train nothing" in err and snapshot(data) == before


def test_mask_loss_weights_that_train_nothing_are_refused():
    from train.data.masks import check_weights

    check_weights(None)
    check_weights([0.0, 1.0])  # only the unmasked region trains: allowed
    with pytest.raises(ConfigError, match=re.escape("data.mask_loss_weight=[0.0, 0.0] weighs every pixel")):
        check_weights([0.0, 0.0])
