"""Validation prompts (sample.prompts, sample.every): a text-to-image fine-tune's preview grids show one row per chosen
prompt, not the first sorted captions; `python -m train.sample --prompts-file` reads the same file; bad input is refused
in one sentence naming the key and the fix."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from routing import ConfigError
from train.sample import default_name, parse_args
from train.schema.sample import preview_every
from train.trainer import Trainer
from conftest import FAST, compose_cfg, run_cli
from tiny_pipelines import flux_pipeline, tiny_vae

# Three distinct captions: today's previews would show all three (the first 4 sorted), one row each.
CAPTIONS = {"a.png": "a red square", "b.png": "a blue square", "c.png": "a green square"}
# Two prompts in no sorted order, none of them a caption.
PROMPTS = ["a wide red disk", "a tiny green star"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A tiny FluxPipeline (2 double + 2 single blocks, 16 latent channels packed 2x2) with text encoders and a VAE."""
    root = tmp_path_factory.mktemp("flux")
    flux_pipeline(root, vae=tiny_vae(latent_channels=4), in_channels=16, num_layers=2).save_pretrained(root / "pipe")
    return root / "pipe"


def captioned_folder(root):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for name, caption in CAPTIONS.items():
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / name)
        (root / name).with_suffix(".txt").write_text(caption + "\n")
    return root


def overrides(pipeline, data, run, *extra):
    return ["+experiment=finetune_flux", "data=captions", f"data.path={data}", f"finetune.pretrained={pipeline}",
            "finetune.dtype=fp32", "finetune.gradient_checkpointing=false", "trainer.mixed_precision=no", "finetune.lora.rank=4",
            "data.resolution=32", "data.alignment=8", "data.aspect_ratios=[1.0]", *FAST, "trainer.batch_size=2",
            "trainer.log_with=none", f"run_dir={run}", *extra]


def pixels(path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def test_sample_every_replaces_trainer_sample_every_when_set():
    assert preview_every(compose_cfg("trainer.sample_every=7")) == 7  # null: the trainer's period
    assert preview_every(compose_cfg("trainer.sample_every=7", "sample.every=3")) == 3
    assert preview_every(compose_cfg("+experiment=finetune_flux", "sample.every=0")) == 0  # off, whatever the experiment says


def test_previews_show_the_file_prompts_as_train_sample_does(pipeline, tmp_path, monkeypatch):
    data, run = captioned_folder(tmp_path / "data"), tmp_path / "run"
    prompts = tmp_path / "prompts.txt"
    monkeypatch.chdir(tmp_path)  # the file is named relative to here; the run's config.yaml stores its absolute path
    prompts.write_text(f"{PROMPTS[0]}\n\n  {PROMPTS[1]}  \n")  # blank lines and surrounding spaces are dropped
    # FAST turns trainer.sample_every off; sample.every=2 gives a preview at step 2 only, beside its checkpoint. CFG (w=2)
    # draws on the null label, which is the validation table's empty prompt (row 2), not the captions' (row 3).
    trainer = Trainer(compose_cfg(*overrides(pipeline, data, run, "sample.prompts=prompts.txt", "sample.every=2",
                                             "trainer.ckpt_every=2", "sample.guidance=2")))
    assert trainer.dataset.captions == sorted(CAPTIONS.values())
    assert trainer.validation.prompts == [*PROMPTS, ""]  # the file's order; row P is the empty prompt (CFG's null label)
    ema = trainer.ema.module.model  # the EMA's own PromptConditioned, which the previews sample
    tables = trainer.backbone.encoder_hidden_states, ema.encoder_hidden_states  # the captions' conditioning, (3 + 1, L, D)
    trainer.fit()
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_0000002.png"]
    preview = pixels(run / "samples" / "step_0000002.png")
    assert OmegaConf.load(run / "config.yaml").sample.prompts == str(prompts)
    # The preview left the training conditioning (the captions' table) as it was, in the trained net and in the EMA.
    assert trainer.backbone.encoder_hidden_states is tables[0] and ema.encoder_hidden_states is tables[1] and ema.num_classes == 3

    # The same prompts sampled from the checkpoint (EMA weights, the preview's steps, seed and guidance) give the same grid:
    # one row per prompt, in the file's order. Today's preview has a row per caption (3 rows, not 2).
    common = ["--per-class", "1", "--steps", "2", "--seed", "0", "--guidance", "2"]
    by_file = run_cli("train.sample", str(run), "--prompts-file", str(prompts), *common)
    assert by_file.returncode == 0, by_file.stderr[-2000:]
    written = run / "checkpoints" / "step_0000002" / by_file.stdout.strip().splitlines()[-1].split()[1]
    by_flags = run_cli("train.sample", str(run), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], *common,
                       "--out", str(tmp_path / "flags.png"))
    assert by_flags.returncode == 0, by_flags.stderr[-2000:]
    flags, from_file = pixels(tmp_path / "flags.png"), pixels(written)
    assert preview.shape == flags.shape == from_file.shape
    # Two rows of one 32x32 sample (the VAE's), 1 px padding, shown at 2x (grids are at least 64 px a side).
    assert preview.shape[:2] == (2 * (2 * 32 + 3), 2 * (32 + 2))
    assert np.array_equal(preview, flags) and np.array_equal(flags, from_file)
    # The same prompts from the file or the flags: the same default name (the digest of the prompts' text), kept.
    again = run_cli("train.sample", str(run), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], *common)
    assert again.returncode == 2 and f"'{written}' exists" in again.stderr and "--overwrite" in again.stderr
    # Other prompts (here: the first captions) give other samples, so the comparison above says which prompts were drawn.
    captions = run_cli("train.sample", str(run), "--classes", "0", "1", *common, "--out", str(tmp_path / "captions.png"))
    assert captions.returncode == 0, captions.stderr[-2000:]
    assert np.abs(pixels(tmp_path / "captions.png") - preview).max() > 8


def test_the_file_digest_names_the_default_grid(tmp_path):
    file = tmp_path / "p.txt"
    file.write_text("\n".join(PROMPTS) + "\n")
    name = default_name(parse_args(["runs/x", "--prompts-file", str(file)]))
    assert name == default_name(parse_args(["runs/x", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]))
    file.write_text(PROMPTS[0] + "\n")  # another prompt list, another file name
    assert default_name(parse_args(["runs/x", "--prompts-file", str(file)])) != name


@pytest.mark.parametrize("value, message", [
    ("missing.txt", "sample.prompts='{tmp}/missing.txt' does not exist; give a text file with one prompt per line."),
    ("empty.txt", "sample.prompts='{tmp}/empty.txt' holds no prompt (it is empty or blank); write one prompt per line."),
    ("blank.txt", "sample.prompts='{tmp}/blank.txt' holds no prompt (it is empty or blank); write one prompt per line."),
    ("[]", "sample.prompts holds no prompt or an empty one; give non-empty texts"),
    ("[1,2]", "sample.prompts=[1, 2] is neither a list of texts nor the path of a text file; quote each prompt"),
])
def test_bad_prompts_are_refused_before_any_work(pipeline, tmp_path, value, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n   \n")
    value = str(tmp_path / value) if value.endswith(".txt") else value
    run = tmp_path / "run"
    cfg = compose_cfg(*overrides(pipeline, tmp_path / "no-data", run, f"sample.prompts={value}", "sample.every=1"))
    with pytest.raises(ConfigError) as refused:
        Trainer(cfg)  # refused by the checks, before the data folder (which does not exist) is read
    assert str(refused.value).startswith(message.format(tmp=tmp_path)) and not run.exists()


def test_prompts_for_a_class_conditional_run_are_refused(tmp_path):
    result = run_cli("train", *FAST, "sample.prompts=[a cat]", f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 2 and not (tmp_path / "run").exists()
    assert "error: sample.prompts gives text prompts, which only a fine-tuned text-to-image model takes" in result.stderr
    assert "this run is class-conditional (finetune.family=None); drop sample.prompts" in result.stderr
    assert "Traceback" not in result.stderr


def test_train_sample_refuses_a_bad_prompts_file_in_one_sentence(tmp_path):
    run = tmp_path / "run"
    Trainer(compose_cfg(*FAST, "trainer.max_steps=1", "trainer.ckpt_every=1", "trainer.log_with=none", f"run_dir={run}")).fit()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "ok.txt").write_text("a cat\n")
    cases = {
        ("--prompts-file", str(tmp_path / "nope.txt")): f"--prompts-file='{tmp_path}/nope.txt' does not exist; give a text file",
        ("--prompts-file", str(tmp_path / "empty.txt")): f"--prompts-file='{tmp_path}/empty.txt' holds no prompt",
        ("--prompts-file", str(tmp_path / "ok.txt"), "--prompt", "a dog"): "give --prompt or --prompts-file, not both",
        ("--prompts-file", str(tmp_path / "ok.txt")): "--prompts-file gives text prompts, which only a fine-tuned text-to-image "
                                                      "model takes",
    }
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for flags, message in cases.items():
        result = run_cli("train.sample", str(run), *flags, "--steps", "1", "--per-class", "1")
        assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written


def test_prompts_need_the_text_encoders_of_the_run(tmp_path):
    """A class-prompt run whose table is a random stand-in has no text encoder to encode validation prompts."""
    from test_finetune_cli import write_pretrained
    from train.data.prompts import random_table, write_table

    write_pretrained("flux", tmp_path / "flux")  # a transformer folder, no text encoders
    table = write_table(random_table("flux", [f"a handwritten {d}" for d in range(10)], (4, 24, 12)), tmp_path / "t.safetensors")
    cfg = compose_cfg(*FAST, "objective=flow", "finetune.family=flux", f"finetune.pretrained={tmp_path / 'flux'}",
                      f"finetune.prompts={table}", "sample.prompts=[a handwritten 7]", f"run_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match=r"^sample.prompts needs the text encoders this run is conditioned with, but its prompt "
                                          r"table '.*t.safetensors' is a random stand-in .* drop sample.prompts"):
        Trainer(cfg)
