"""Write a prompt table (one prompt per class, plus the empty prompt) for fine-tuning: `python -m train.encode_prompts`.

    python -m train.encode_prompts --family flux --pipeline weights/FLUX.1-dev \\
        --prompts "a photo of a T-shirt" "a photo of a trouser" --out prompts/flux.safetensors
    python -m train.encode_prompts --family sd3 --pipeline weights/sd3.5-medium --prompts-file classes.txt --out p.safetensors
    python -m train.encode_prompts --family flux --random 8,64,32 --prompts-file classes.txt --out p.safetensors  # stand-in

Prompt k is class k (the data's label order). The table format and the encoding are train/data/prompts.py;
`finetune.prompts=` points a run at the file (docs/finetuning.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import torch

from routing import ConfigError
from train.cli import ArgumentParser, bounded, device, existing, friendly_errors, writable_file
from train.data.prompts import DTYPES, PIPELINES, encode_table, random_table, write_table
from train.files import read_text


def sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. --random 8,64,32)") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m train.encode_prompts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(PIPELINES), help="the model family the table conditions")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pipeline", help="local diffusers pipeline folder with the model's text encoders and tokenizers")
    source.add_argument("--random", type=sizes, metavar="L,D[,P]",
                        help="a stand-in of fixed random embeddings: L text tokens of width D (and pooled width P for flux, sd3)")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompts", nargs="+", help="one prompt per class, in class order")
    prompts.add_argument("--prompts-file", type=existing("prompts file"), help="a text file with one prompt per line, in class order")
    parser.add_argument("--out", required=True, type=writable_file, help="the table's path (.safetensors)")
    parser.add_argument("--overwrite", action="store_true", help="replace the table at --out if it exists (by default "
                        "it is kept and the command refuses: runs that read it could no longer resume or sample)")
    parser.add_argument("--max-sequence-length", type=bounded(int, 1, 4096, example="--max-sequence-length 77"),
                        help="text tokens per prompt (default: the pipeline's, e.g. 512 for Flux); fewer makes a smaller table")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of the text encoders and of the table they write (--pipeline)")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=bounded(int, 0, example="--seed 0"), default=0, help="seed of --random")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.overwrite:  # refused before the text encoders load, as train.sample's grid is
        raise ConfigError(f"'{args.out}' exists (a prompt table: runs that read it through finetune.prompts= could no "
                          "longer resume or sample if it changed); pass --overwrite to replace it, or --out PATH to "
                          "write elsewhere.")
    if args.family == "wan":  # encode_table serves Wan's caption cache and train.sample --prompt, not a table
        parser.error("Wan trains on captioned clips (data=videos), each caption encoded into the data's cache, so no run "
                     "reads a Wan prompt table; write a caption beside each clip (docs/finetuning_video.md)")
    if args.prompts_file:
        fix = "pass a UTF-8 text file with one prompt per line, in class order"
        args.prompts = [line.strip() for line in read_text(args.prompts_file, fix).splitlines() if line.strip()]
    args.texts = args.prompts
    if not args.texts or any(not t for t in args.texts):
        parser.error("every class needs a non-empty prompt (the empty prompt is added as the null class)")
    return args


@friendly_errors
def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.random is not None:
        table = random_table(args.family, args.texts, args.random, args.seed)
    else:
        table = encode_table(args.family, args.pipeline, args.texts, device=args.device, dtype=args.dtype,
                             max_sequence_length=args.max_sequence_length)
    out = write_table(table, args.out)
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in table.tensors.items())
    what = "RANDOM STAND-IN embeddings (no text encoder; for tests and demos only)" if table.stand_in else f"encoded with {table.source}"
    print(f"wrote {out}: {table.family}, {table.num_classes} class prompts + the empty prompt (null class), {shapes}; {what}")
    return out


if __name__ == "__main__":
    main()
