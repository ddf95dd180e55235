"""`python -m train.encode_prompts`: prompt tables from tiny diffusers pipelines built offline (random CLIP and T5
encoders from configs, tokenizers from in-memory vocabularies), the random stand-in, and the refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from train.data.prompts import read_table
from train.encode_prompts import main
from train.trainer import Trainer
from conftest import FAST, compose_cfg, run_module

WORDS = ["<pad>", "</s>", "<unk>", "a", "photo", "of", "shirt", "trouser", "handwritten"]
PROMPTS = ["a photo of a shirt", "a photo of a trouser"]
TEXT_WIDTH, CLIP_WIDTH = 24, 8  # T5 width (the transformers' joint/caption width), each CLIP's width


def clip_tokenizer(folder):
    """A character-level CLIP BPE tokenizer (no merges) over a-z."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch], vocab[ch + "</w>"] = len(vocab), len(vocab) + 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=8), len(vocab)


def t5_tokenizer():
    """A word-level T5 tokenizer (a Unigram model over WORDS, as T5's own tokenizer is a Unigram one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import T5TokenizerFast

    backend = Tokenizer(models.Unigram([(w, -1.0) for w in WORDS], unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """family -> a saved tiny pipeline folder (text encoders, tokenizers, scheduler, transformer; no VAE)."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    root = tmp_path_factory.mktemp("pipelines")
    torch.manual_seed(0)
    clip_tok, vocab = clip_tokenizer(root / "clip-vocab")
    clip_cfg = CLIPTextConfig(vocab_size=vocab, hidden_size=CLIP_WIDTH, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                              max_position_embeddings=8, projection_dim=CLIP_WIDTH, bos_token_id=0, eos_token_id=1)
    t5 = T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=TEXT_WIDTH, d_ff=16, d_kv=8, num_layers=1, num_heads=2))
    flow = diffusers.FlowMatchEulerDiscreteScheduler()
    built = {
        "flux": diffusers.FluxPipeline(
            scheduler=flow, vae=None, text_encoder=CLIPTextModel(clip_cfg), tokenizer=clip_tok, text_encoder_2=t5,
            tokenizer_2=t5_tokenizer(),
            transformer=diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2,
                                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_WIDTH,
                                                         pooled_projection_dim=CLIP_WIDTH, axes_dims_rope=(4, 6, 6))),
        "sd3": diffusers.StableDiffusion3Pipeline(
            scheduler=flow, vae=None, text_encoder=CLIPTextModelWithProjection(clip_cfg), tokenizer=clip_tok,
            text_encoder_2=CLIPTextModelWithProjection(clip_cfg), tokenizer_2=clip_tok, text_encoder_3=t5, tokenizer_3=t5_tokenizer(),
            transformer=None),
        "pixart": diffusers.PixArtSigmaPipeline(tokenizer=t5_tokenizer(), text_encoder=t5, vae=None, transformer=None,
                                                scheduler=diffusers.DPMSolverMultistepScheduler()),
    }
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
    result = run_module("train.encode_prompts", "--family", "pixart", "--random", "5,24", "--prompts-file", str(tmp_path / "classes.txt"),
                        "--out", str(tmp_path / "p.safetensors"))
    assert result.returncode == 0, result.stderr
    assert "RANDOM STAND-IN" in result.stdout
    table = read_table(tmp_path / "p.safetensors", "pixart")
    assert table.stand_in and table.prompts == ["a T-shirt", "a trouser", "a pullover", ""]
    assert table.tensors["encoder_hidden_states"].shape == (4, 5, 24) and table.tensors["encoder_attention_mask"].all()
    with pytest.raises(SystemExit) as exit_:
        main(["--family", "flux", "--random", "5,24", "--prompts", "a", "--out", str(tmp_path / "q.safetensors")])
    assert exit_.value.code == 2 and "--random for flux takes L,D,P" in capsys.readouterr().err
