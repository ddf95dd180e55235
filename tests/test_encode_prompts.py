"""`python -m train.encode_prompts`: prompt tables from tiny diffusers pipelines built offline (random CLIP and T5
encoders from configs, tokenizers from in-memory vocabularies), the random stand-in, and the refusals."""

from __future__ import annotations

import shutil

import pytest
import torch

from train.data.prompts import read_table
from train.encode_prompts import main
from train.trainer import Trainer
from conftest import FAST, compose_cfg, run_cli
from tiny_pipelines import TEXT_WIDTH, flux_pipeline, pixart_pipeline, sd3_pipeline

PROMPTS = ["a photo of a shirt", "a photo of a trouser"]


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """family -> a saved tiny pipeline folder (text encoders, tokenizers, scheduler, transformer; no VAE)."""
    root = tmp_path_factory.mktemp("pipelines")
    built = {"flux": flux_pipeline(root), "sd3": sd3_pipeline(root), "pixart": pixart_pipeline(root)}
    for family, pipe in built.items():
        pipe.save_pretrained(root / family)
    return {family: root / family for family in built}


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart"])
def test_the_table_holds_the_pipelines_own_text_conditioning(pipelines, family, tmp_path):
    from backbones.adapters import TABLE_KEYS
    from train.data.prompts import load_text_pipeline

    out = main(["--family", family, "--pipeline", str(pipelines[family]), "--prompts", *PROMPTS, "--max-sequence-length", "6",
                "--out", str(tmp_path / "table.safetensors")])
    table = read_table(out, family)
    assert table.prompts == [*PROMPTS, ""] and table.num_classes == 2 and not table.stand_in
    # Rows 0..K-1 are the class prompts and row K the empty one, exactly as the pipeline encodes them.
    pipe, texts = load_text_pipeline(family, pipelines[family]), [*PROMPTS, ""]
    with torch.no_grad():  # as encode_table: the autograd path may round the last bit differently
        expected = {
            "flux": lambda: pipe.encode_prompt(texts, prompt_2=None, device="cpu", max_sequence_length=6)[:2],
            "sd3": lambda: pipe.encode_prompt(texts, None, None, device="cpu", do_classifier_free_guidance=False, max_sequence_length=6)[::2],
            "pixart": lambda: pipe.encode_prompt(texts, do_classifier_free_guidance=False, device="cpu", clean_caption=False,
                                                 max_sequence_length=6)[:2],
        }[family]()
    for name, tensor in zip(TABLE_KEYS[family], expected):
        assert torch.equal(table.tensors[name], tensor), name
    hidden = table.tensors["encoder_hidden_states"]
    assert hidden.shape[0] == 3 and hidden.shape[-1] == TEXT_WIDTH and not torch.equal(hidden[0], hidden[2])


def test_an_encoded_table_fine_tunes_the_pipelines_own_transformer(pipelines, tmp_path):
    # The pipeline folder is both finetune.pretrained (its transformer/) and the text encoders' source.
    prompts = [f"a handwritten {w}" for w in ("shirt", "trouser", "photo", "of", "a", "shirt", "trouser", "photo", "of", "a")]
    table = main(["--family", "flux", "--pipeline", str(pipelines["flux"]), "--prompts", *prompts, "--max-sequence-length", "4",
                  "--out", str(tmp_path / "digits.safetensors")])
    cfg = compose_cfg(*FAST, "objective=flow", "routing=random", "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 1, end_layer_idx: 1}]",
                      "finetune.family=flux", f"finetune.pretrained={pipelines['flux']}",
                      f"finetune.prompts={table}", "trainer.max_steps=1", f"run_dir={tmp_path / 'run'}")
    assert all(torch.isfinite(torch.tensor(Trainer(cfg).fit())))


def test_missing_or_partial_pipelines_are_refused_naming_what_to_fetch(pipelines, tmp_path, capsys):
    partial = tmp_path / "partial"
    shutil.copytree(pipelines["flux"], partial)
    shutil.rmtree(partial / "text_encoder_2")
    for folder, message in ((tmp_path / "FLUX.1-dev", "holds no diffusers FluxPipeline (model_index.json)"),
                            (partial, "could not load the text encoders"),
                            (pipelines["sd3"], "holds a StableDiffusion3Pipeline, not the FluxPipeline")):
        with pytest.raises(SystemExit) as exit_:
            main(["--family", "flux", "--pipeline", str(folder), "--prompts", "a", "--out", str(tmp_path / "t.safetensors")])
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after diffusers' loading progress bar, if any
        assert exit_.value.code == 2 and err.startswith("error: ") and message in err, err
        if folder != pipelines["sd3"]:
            assert "huggingface-cli download black-forest-labs/FLUX.1-dev --include 'model_index.json'" in err
    assert not (tmp_path / "t.safetensors").exists()


def test_random_stand_in_from_the_command_line(tmp_path, capsys):
    (tmp_path / "classes.txt").write_text("a T-shirt\na trouser\n\na pullover\n")
    result = run_cli("train.encode_prompts", "--family", "pixart", "--random", "5,24", "--prompts-file", str(tmp_path / "classes.txt"),
                        "--out", str(tmp_path / "p.safetensors"))
    assert result.returncode == 0, result.stderr
    assert "RANDOM STAND-IN" in result.stdout
    table = read_table(tmp_path / "p.safetensors", "pixart")
    assert table.stand_in and table.prompts == ["a T-shirt", "a trouser", "a pullover", ""]
    assert table.tensors["encoder_hidden_states"].shape == (4, 5, 24) and table.tensors["encoder_attention_mask"].all()
    with pytest.raises(SystemExit) as exit_:
        main(["--family", "flux", "--random", "5,24", "--prompts", "a", "--out", str(tmp_path / "q.safetensors")])
    assert exit_.value.code == 2 and "--random for flux takes L,D,P" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # no run reads a Wan table: its clips carry their captions
        main(["--family", "wan", "--random", "5,24", "--prompts", "a", "--out", str(tmp_path / "w.safetensors")])
    assert exit_.value.code == 2 and "so no run reads a Wan prompt table" in capsys.readouterr().err
    assert not (tmp_path / "w.safetensors").exists()


def test_an_existing_table_is_kept_unless_overwrite(tmp_path):
    """Runs read their table again to resume and sample: a second command into the same --out refuses, unless told."""
    out = tmp_path / "p.safetensors"
    command = ["--family", "pixart", "--random", "5,24", "--out", str(out)]
    assert run_cli("train.encode_prompts", *command, "--prompts", "a T-shirt", "a trouser").returncode == 0
    before = out.read_bytes()
    again = run_cli("train.encode_prompts", *command, "--prompts", "a dress")
    assert again.returncode == 2 and "Traceback" not in again.stderr and out.read_bytes() == before
    (line,) = again.stderr.strip().splitlines()
    assert line.startswith(f"error: '{out}' exists (a prompt table") and "--overwrite" in line and "--out PATH" in line
    assert run_cli("train.encode_prompts", *command, "--prompts", "a dress", "--overwrite").returncode == 0
    assert read_table(out, "pixart").prompts == ["a dress", ""]
