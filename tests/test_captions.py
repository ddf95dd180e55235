"""`data=captions`: captioned image folders of several aspect ratios, encoded with a tiny pipeline's own text encoders and
VAE into a cache per bucket, trained with one bucket per batch, sampled with a prompt from the command line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from routing import ConfigError
from train.data.buckets import BucketSchedule, bucket_sizes, fit_to_bucket, nearest_bucket
from train.data.caption_cache import prepare_captions
from train.data.captions import list_captioned
from train.trainer import Trainer
from conftest import FAST, compose_cfg
from tiny_pipelines import flux_pipeline, tiny_vae

CAPTIONS = {"square/a.png": "a red square", "square/b.png": "a blue square", "square/c.png": "a red square",
            "wide/d.png": "a wide blue disk", "wide/e.png": "a wide red disk", "wide/f.png": "a wide red disk"}
SIZES = {"square": (32, 32), "wide": (48, 32)}  # (width, height): buckets 32x32 and 40x24 at resolution 32, alignment 8
BUCKETS = ["data.resolution=32", "data.alignment=8", "data.aspect_ratios=[1.0,1.5]"]


def write_images(root, captions=CAPTIONS):
    rng = np.random.default_rng(0)
    for name, caption in captions.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        width, height = SIZES[path.parent.name]
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
        path.with_suffix(".txt").write_text(caption + "\n")
    return root


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A tiny FluxPipeline (2 double + 2 single blocks, 16 latent channels packed 2x2) with text encoders and a VAE."""
    root = tmp_path_factory.mktemp("flux")
    flux_pipeline(root, vae=tiny_vae(latent_channels=4), in_channels=16, num_layers=2).save_pretrained(root / "pipe")
    return root / "pipe"


def overrides(pipeline, data, run, *extra):
    return ["+experiment=finetune_flux", "data=captions", f"data.path={data}", f"finetune.pretrained={pipeline}",
            "finetune.dtype=fp32", "finetune.gradient_checkpointing=false", "trainer.mixed_precision=no", "finetune.lora.rank=4",
            *BUCKETS, *FAST, "trainer.batch_size=2", f"run_dir={run}", *extra]


def test_buckets_have_about_equal_area_and_take_the_nearest_aspect_ratio():
    sizes = bucket_sizes(1024, 64, [1.0, 1.5, 0.667, 1.778])
    assert sizes[0] == (1024, 1024) and all(w % 64 == 0 and h % 64 == 0 for w, h in sizes)
    assert all(abs(w * h / 1024**2 - 1) < 0.08 for w, h in sizes)
    assert nearest_bucket((3000, 2000), sizes) == 1 and nearest_bucket((900, 1600), sizes) == 2
    image = fit_to_bucket(Image.new("RGB", (300, 100)), (64, 32))
    assert image.size == (64, 32)


def test_bucket_batches_are_one_bucket_each_and_a_pure_function_of_the_step():
    bucket_of = [0, 1, 0, 0, 1, 2, 0]
    schedule, again = BucketSchedule(bucket_of), BucketSchedule(bucket_of)
    epoch = [schedule.batch(3, step, 2) for step in range(schedule.batches_per_epoch(2))]
    assert schedule.batches_per_epoch(2) == 2 + 1 + 1
    assert all(len({bucket_of[i] for i in batch.tolist()}) == 1 for batch in epoch)
    assert sorted(set(torch.cat(epoch).tolist())) == list(range(len(bucket_of)))  # every image, every epoch
    assert all(torch.equal(schedule.batch(3, s, 2), again.batch(3, s, 2)) for s in range(12))
    assert not all(torch.equal(schedule.batch(3, s, 2), schedule.batch(4, s, 2)) for s in range(4))


def test_flux_fine_tunes_on_two_aspect_ratios_then_samples_a_prompt(pipeline, tmp_path):
    from train.sample import main as sample

    data = write_images(tmp_path / "data")
    trainer = Trainer(compose_cfg(*overrides(pipeline, data, tmp_path / "run")))
    ds = trainer.dataset
    assert ds.num_classes == 4 and ds.captions[0] == "a blue square"  # distinct captions, sorted; row 4 is ""
    assert sorted(ds.bucket_shapes) == [(4, 12, 20), (4, 16, 16)]  # VAE factor 2: 40x24 and 32x32 pixels
    # Caption dropout is the trainer's label dropout: the null label K is the empty caption, which CFG uses too.
    assert ds.prompt_table().prompts == [*ds.captions, ""] and trainer.backbone.num_classes == ds.num_classes == 4
    seen = set()
    for _ in range(4):  # 2 + 1 + ... batches: both buckets within an epoch of 4 batches
        shape = trainer._batch_shape()
        loss = trainer.train_step()
        grid = (shape[1] // 2, shape[2] // 2)  # Flux packs 2x2 latent pixels into a token
        # The token grid, the rotary ids and the route follow the bucket: the route kept half of its tokens.
        assert trainer.backbone.adapter.last_grid == grid and np.isfinite(loss)
        (mask,) = trainer.backbone.router.last_masks
        assert mask.shape == (2, grid[0] * grid[1]) and (mask.sum(1) == grid[0] * grid[1] // 2).all()
        seen.add(shape)
    assert seen == {(4, 12, 20), (4, 16, 16)}
    trainer.save()
    trainer._release_run_dir()

    # A prompt given to train.sample is encoded exactly as the training captions were (same encoders, same text length).
    from train.data.prompts import encode_table, text_pipeline_of

    table = ds.prompt_table()
    again = encode_table("flux", text_pipeline_of(trainer.cfg), ["a red square"], like=table.tensors["encoder_hidden_states"])
    row = ds.captions.index("a red square")
    assert all(torch.equal(again.tensors[k][0], table.tensors[k][row]) for k in table.tensors)

    out = sample([str(tmp_path / "run"), "--prompt", "a red disk", "--prompt", "a blue square", "--per-class", "2", "--steps", "2",
                  "--size", "40x24", "--out", str(tmp_path / "grid.png")])
    with Image.open(out) as grid:
        # Two rows (one per prompt) of two 40x24 images (decoded by the VAE), with 1 px padding.
        assert grid.size == (2 * 40 + 3, 2 * 24 + 3)


def test_the_cache_is_rewritten_only_where_captions_images_or_encoders_changed(pipeline, tmp_path):
    data = write_images(tmp_path / "data")
    cfg = compose_cfg(*overrides(pipeline, data, tmp_path / "run"))
    logged = []
    folder = prepare_captions(cfg, log=logged.append)
    assert len(logged) == 3 and "encoding 4 distinct captions" in logged[0]
    text = (folder / "text.safetensors").read_bytes()
    written = (folder / "manifest.json").stat()
    logged.clear()
    prepare_captions(cfg, log=logged.append)
    assert logged == []  # nothing changed: nothing encoded
    again = (folder / "manifest.json").stat()  # and the manifest not rewritten (a rewrite is a new file: a new inode)
    assert (again.st_ino, again.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)

    (data / "wide" / "d.txt").write_text("a tall blue disk")
    prepare_captions(cfg, log=logged.append)
    assert logged == ["data=captions: encoding 4 distinct captions with the text encoders of " + str(pipeline)]
    assert (folder / "text.safetensors").read_bytes() != text
    assert json.loads((folder / "manifest.json").read_text())["captions"][2] == "a tall blue disk"

    logged.clear()
    Image.new("RGB", (48, 32), "white").save(data / "wide" / "e.png")
    prepare_captions(cfg, log=logged.append)
    assert logged == ["data=captions: encoding 3 images of bucket 40x24 with the VAE in " + str(pipeline / "vae")]

    logged.clear()
    moved = tmp_path / "pipe2"
    shutil.copytree(pipeline, moved)
    from transformers import T5EncoderModel

    torch.manual_seed(1)
    T5EncoderModel(T5EncoderModel.config_class.from_pretrained(moved / "text_encoder_2")).save_pretrained(moved / "text_encoder_2")
    prepare_captions(compose_cfg(*overrides(pipeline, data, tmp_path / "run"), f"data.pipeline={moved}"), log=logged.append)
    # Other text-encoder weights: the captions are encoded again; the copied VAE is the same, so its latents stay.
    assert logged == ["data=captions: encoding 4 distinct captions with the text encoders of " + str(moved)]


@pytest.mark.parametrize("problem, message", [
    ("missing", "has no caption file; write its caption to"),
    ("empty", "is empty; write the image's caption into it"),
    ("unreadable", "is unreadable (UnidentifiedImageError); replace or delete it."),
    ("no images", "holds no images"),
])
def test_bad_folders_are_refused_in_one_sentence(tmp_path, problem, message):
    data = write_images(tmp_path / "data")
    if problem == "missing":
        (data / "wide" / "d.txt").unlink()
    elif problem == "empty":
        (data / "wide" / "d.txt").write_text("  \n")
    elif problem == "unreadable":
        (data / "wide" / "d.png").write_bytes(b"not a png")
    else:
        shutil.rmtree(data)
        data.mkdir()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        list_captioned(data)
    assert "\n" not in str(err.value)


def test_the_command_line_refuses_before_touching_the_run_folder(pipeline, tmp_path, capsys):
    from train.cli import precompose  # what `python -m train` runs before Hydra makes the run folder

    data = write_images(tmp_path / "data")
    (data / "square" / "b.txt").unlink()
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        precompose("config", overrides(pipeline, data, run))
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        f"error: image '{data / 'square' / 'b.png'}' has no caption file; write its caption to '{data / 'square' / 'b.txt'}' "
        "(one line of text), or move the image out of data.path."]
    assert not run.exists() and sorted(p.name for p in (data / "square").iterdir()) == ["a.png", "a.txt", "b.png", "c.png", "c.txt"]


def test_a_resumed_captions_run_repeats_the_uninterrupted_one(pipeline, tmp_path):
    data = write_images(tmp_path / "data")

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    def run(name, *extra):
        Trainer(compose_cfg(*overrides(pipeline, data, tmp_path / name, "trainer.ckpt_every=2", *extra))).fit()

    run("straight", "trainer.max_steps=4")
    run("split", "trainer.max_steps=2")
    run("split", "trainer.max_steps=4", "resume=true")
    assert losses(tmp_path / "split") == losses(tmp_path / "straight") and len(losses(tmp_path / "straight")) == 4


def test_captions_need_a_text_family_and_no_prompt_table(pipeline, tmp_path):
    from train.data.captions import check_captions
    from train.schema import check_config

    with pytest.raises(ConfigError, match="data=captions conditions a text-to-image model on its captions, but finetune.family=None"):
        check_captions(compose_cfg("data=captions", f"data.path={tmp_path}", "run_dir=/tmp/unused"))
    with pytest.raises(ConfigError, match="drop finetune.prompts"):
        check_config(compose_cfg(*overrides(pipeline, tmp_path, "/tmp/unused"), f"finetune.prompts={pipeline / 'model_index.json'}"))


def test_masks_come_with_the_batch_fitted_to_its_bucket(pipeline, tmp_path):
    """`name.mask.png` beside an image: the dataset returns it with the batch at the bucket's latent size, and
    train.data.masks turns it into the router's force-keep tokens and the loss weight (data.mask_loss_weight)."""
    from train.data.masks import mask_inputs

    data = write_images(tmp_path / "data")
    mask = Image.new("L", (48, 32), 0)
    mask.paste(255, (0, 0, 12, 8))  # the top-left corner of a wide image
    mask.save(data / "wide" / "d.mask.png")
    trainer = Trainer(compose_cfg(*overrides(pipeline, data, tmp_path / "run"), "data.mask_loss_weight=[2.0,0.5]"))
    ds, patch = trainer.dataset, trainer.backbone.patch
    index = {f: i for i, f in enumerate(ds.manifest["files"])}
    wide = torch.tensor([index["wide/d.png"], index["wide/e.png"]])
    masks = ds.masks(wide)
    assert masks.coverage.shape == (2, *ds.shape_of(wide)[1:]) and masks.present.tolist() == [True, False]
    keep, weight = mask_inputs(ds, wide, patch, ds.mask_loss_weight)
    h, w = ds.shape_of(wide)[1:]
    assert keep.shape == (2, (h // patch) * (w // patch)) and keep[0].any() and not keep[1].any()
    assert weight.shape == (2, 1, h, w) and weight[0].max() == 2.0 and weight[0].min() == 0.5 and weight[1].eq(1).all()
    assert ds.masks(torch.tensor([index["square/a.png"]])).present.tolist() == [False]  # no mask beside it
    trainer._release_run_dir()
