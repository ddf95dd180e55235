"""A tiny Wan pipeline and a moving-shapes clip folder, written offline, for the CPU demo of docs/finetuning_video.md.

    python docs/figures/finetune_tiny_wan.py --pipeline runs/tiny-wan/pipeline --clips runs/tiny-wan/clips

The pipeline folder is a real diffusers WanPipeline with random weights: a WanTransformer3DModel (4 blocks, 2 heads
of 12 channels), an AutoencoderKLWan (4x temporal and 8x spatial compression, 4 latent channels), a umT5 text encoder
(1 layer, 16 wide) with a word-level tokenizer over the fixture's words, and Wan's UniPC scheduler. Training reads
it as any Wan pipeline folder (finetune.pretrained=...): its text encoder encodes the captions, its VAE the clips.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.data.moving_shapes import WORDS, write_moving_shapes  # noqa: E402

TEXT_WIDTH = 16
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                   text_dim=TEXT_WIDTH, freq_dim=16, ffn_dim=48, num_layers=4, rope_max_seq_len=64)
VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
           latents_mean=[0.0] * 4, latents_std=[1.0] * 4)


def tokenizer():
    """A word-level T5 tokenizer (a Unigram model over the fixture's words, as umT5's own is a Unigram one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import T5TokenizerFast

    vocab = ["<pad>", "</s>", "<unk>", *WORDS]
    backend = Tokenizer(models.Unigram([(w, -1.0) for w in vocab], unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0), len(vocab)


def tiny_pipeline(seed: int = 0, channels: int = 4):
    """channels: of the transformer's input and output: 4, the tiny VAE's latents; 3 to train on pixels (data.vae=pixels)."""
    import diffusers
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tok, vocab = tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=vocab, d_model=TEXT_WIDTH, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    return diffusers.WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=diffusers.AutoencoderKLWan(**VAE),
                                 scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                                             flow_shift=3.0),
                                 transformer=diffusers.WanTransformer3DModel(**{**TRANSFORMER, "in_channels": channels,
                                                                                "out_channels": channels}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", type=Path, help="write the tiny WanPipeline here")
    parser.add_argument("--clips", type=Path, help="write the moving-shapes clips (GIFs and frame folders, with captions) here")
    parser.add_argument("--num-clips", type=int, default=16)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--pixels", action="store_true", help="a transformer on RGB frames (data.vae=pixels) instead of latents")
    args = parser.parse_args(argv)
    if args.pipeline:
        tiny_pipeline(channels=3 if args.pixels else 4).save_pretrained(args.pipeline)
        print(f"wrote a tiny WanPipeline to {args.pipeline}")
    if args.clips:
        write_moving_shapes(args.clips, clips=args.num_clips, frames=args.frames, size=args.size)
        print(f"wrote {args.num_clips} captioned clips of {args.frames} frames ({args.size}x{args.size}) to {args.clips}")


if __name__ == "__main__":
    main()
