"""Tiny diffusers pipelines built offline from configs: random CLIP and T5 text encoders, tokenizers from in-memory
vocabularies, a tiny VAE and a tiny transformer. No model hub is reachable from the test machines."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ["<pad>", "</s>", "<unk>", "a", "photo", "of", "shirt", "trouser", "handwritten", "red", "blue", "square", "disk",
         "wide", "tall", "small", "large", "bag", "boot", "sandal", "sneaker", "dress", "coat", "pullover", "t-shirt", "ankle"]
TEXT_WIDTH, CLIP_WIDTH = 24, 8  # T5 width (the transformers' joint/caption width), each CLIP's width


def clip_tokenizer(folder: Path):
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


def tiny_vae(latent_channels: int = 4, seed: int = 0):
    """An AutoencoderKL with factor 2 (two blocks), Flux's scaling and shift convention."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         block_out_channels=(8, 16), layers_per_block=1, latent_channels=latent_channels, norm_num_groups=8,
                         sample_size=32, scaling_factor=0.5, shift_factor=0.1)


def text_encoders(root: Path, seed: int = 0):
    """(CLIP config, CLIP tokenizer, T5 encoder) shared by the pipelines below."""
    from transformers import CLIPTextConfig, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip_tok, vocab = clip_tokenizer(root / "clip-vocab")
    clip_cfg = CLIPTextConfig(vocab_size=vocab, hidden_size=CLIP_WIDTH, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                              max_position_embeddings=8, projection_dim=CLIP_WIDTH, bos_token_id=0, eos_token_id=1)
    t5 = T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=TEXT_WIDTH, d_ff=16, d_kv=8, num_layers=1, num_heads=2))
    return clip_cfg, clip_tok, t5


def flux_pipeline(root: Path, *, vae=None, seed: int = 0, **transformer):
    import diffusers
    from transformers import CLIPTextModel

    clip_cfg, clip_tok, t5 = text_encoders(root, seed)
    config = {**dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                     joint_attention_dim=TEXT_WIDTH, pooled_projection_dim=CLIP_WIDTH, axes_dims_rope=(4, 6, 6)), **transformer}
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=CLIPTextModel(clip_cfg), tokenizer=clip_tok,
        text_encoder_2=t5, tokenizer_2=t5_tokenizer(), transformer=diffusers.FluxTransformer2DModel(**config))


def sd3_pipeline(root: Path, *, vae=None, transformer=None, seed: int = 0):
    import diffusers
    from transformers import CLIPTextModelWithProjection

    clip_cfg, clip_tok, t5 = text_encoders(root, seed)
    return diffusers.StableDiffusion3Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=CLIPTextModelWithProjection(clip_cfg),
        tokenizer=clip_tok, text_encoder_2=CLIPTextModelWithProjection(clip_cfg), tokenizer_2=clip_tok, text_encoder_3=t5,
        tokenizer_3=t5_tokenizer(), transformer=transformer)


def pixart_pipeline(root: Path, seed: int = 0):
    import diffusers

    _, _, t5 = text_encoders(root, seed)
    return diffusers.PixArtSigmaPipeline(tokenizer=t5_tokenizer(), text_encoder=t5, vae=None, transformer=None,
                                         scheduler=diffusers.DPMSolverMultistepScheduler())
