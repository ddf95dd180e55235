"""Does TREAD help LoRA fine-tuning? A CPU-sized answer on Fashion-MNIST with a tiny Flux-shaped model.

    OMP_NUM_THREADS=1 python docs/figures/tread_lora_evidence.py --work runs/tread-lora --out docs/figures/tread_lora

Every step goes through the project's own command line (`python -m train`, data=captions) and is skipped when its
result is already on disk, so a killed run continues where it stopped:

1. data: Fashion-MNIST (the Debian package's idx files) written as captioned PNG folders: classes 0-4 of the train
   split for pre-training, a LoRA set of `--per-class` images of each of classes 5-9. Captions are the class name
   plus a per-image attribute: "small" or "large", whether the garment covers fewer or more pixels than its class's
   median ("a sandal small").
2. pipeline: a tiny FluxPipeline built from configs: random CLIP and T5 text encoders (word-level tokenizer over
   the caption words), no VAE (pixels, 1 channel packed 2x2: 256 image tokens), a FluxTransformer2DModel of 2
   double-stream + 4 single-stream blocks, 64 wide (4 heads of 16).
3. pretrain: every weight on classes 0-4, dense (no routing), `--pretrain-steps`; its EMA transformer becomes the
   "pretrained" pipeline.
4. lora: LoRA rank 16 on the attention projections of that pipeline, on classes 5-9, with routing none, random and
   structured (SPRINT's structured selection; 0.5 over blocks 2..-2, the preset's route), 3 seeds, `--steps` steps each (equal steps); then the routed policies
   again for as many steps as the dense run's median training time buys at their measured median step time
   (equal wall-clock).
5. score: per run, `--per-attr` samples of each (class, attribute) of classes 5-9 (default 10: 100 samples;
   `--sample-steps` Euler steps, default 16; no CFG), scored with the project's Fashion-MNIST classifier:
   classifier-FD against 1000 held-out TEST images of classes 5-9, and class accuracy (which of the ten classes
   the classifier sees). The untouched pretrained model and as many real train images of classes 5-9 as samples
   (the floor) are scored the same way.
6. report: means over the 3 seeds with 95% t-intervals, differences to routing none paired by seed, sample grids.
7. routed sampling: the equal-step routed runs scored again with routing forced at 0.5 over their trained routes
   at sampling (train.sample --route-ratio 0.5), to see how much of their gap is the train/test mismatch of routing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

NAMES = ("top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")
WORDS = ["<pad>", "</s>", "<unk>", "a", *NAMES, "small", "large"]
PRETRAIN_CLASSES, LORA_CLASSES = range(0, 5), range(5, 10)
FLUX = dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=4,
            joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
POLICIES = ("none", "random", "structured")
ROUTE = "routing.routes=[{selection_ratio: 0.5, start_layer_idx: 2, end_layer_idx: -2}]"


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# 1. Data.

def write_folders(work: Path, per_class: int) -> None:
    from PIL import Image

    from train.data.fashion_mnist import fashion_mnist

    if (work / "data" / "done").is_file():
        return
    train = fashion_mnist(split="train")
    x, y = train.images, train.labels
    ink = (x > -0.5).float().mean((1, 2, 3))  # (n,): fraction of the 32x32 pixels the garment covers
    medians = {c: ink[y == c].median() for c in range(10)}
    g = torch.Generator().manual_seed(0)
    for folder, classes, limit in (("pretrain", PRETRAIN_CLASSES, None), ("lora", LORA_CLASSES, per_class)):
        shutil.rmtree(work / "data" / folder, ignore_errors=True)
        for c in classes:
            picks = torch.nonzero(y == c)[:, 0]
            picks = picks[torch.randperm(len(picks), generator=g)[:limit]] if limit else picks
            (work / "data" / folder / NAMES[c]).mkdir(parents=True)
            for i in picks.tolist():
                pixels = ((x[i, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()  # exact: the idx bytes
                stem = work / "data" / folder / NAMES[c] / f"{i:05d}"
                Image.fromarray(pixels, mode="L").save(stem.with_suffix(".png"))
                attr = "large" if ink[i] > medians[c] else "small"
                stem.with_suffix(".txt").write_text(f"a {NAMES[c]} {attr}\n")
    (work / "data" / "done").write_text("ok\n")
    log(f"data: {work / 'data' / 'pretrain'} (classes 0-4), {work / 'data' / 'lora'} ({per_class} per class of 5-9)")


# 2. The tiny pipeline.

def write_pipeline(folder: Path) -> None:
    import diffusers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    if (folder / "model_index.json").is_file():
        return
    torch.manual_seed(0)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch], vocab[ch + "</w>"] = len(vocab), len(vocab) + 1
    (folder / "clip-vocab").mkdir(parents=True, exist_ok=True)
    (folder / "clip-vocab" / "vocab.json").write_text(json.dumps(vocab))
    (folder / "clip-vocab" / "merges.txt").write_text("#version: 0.2\n")
    clip_tok = CLIPTokenizer(str(folder / "clip-vocab" / "vocab.json"), str(folder / "clip-vocab" / "merges.txt"), model_max_length=24)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=24, bos_token_id=0, eos_token_id=1))
    backend = Tokenizer(models.Unigram([(w, -1.0) for w in WORDS], unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    t5_tok = T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0)
    t5 = T5EncoderModel(T5Config(vocab_size=len(WORDS), d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4))
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=clip, tokenizer=clip_tok,
                                  text_encoder_2=t5, tokenizer_2=t5_tok, transformer=diffusers.FluxTransformer2DModel(**FLUX))
    pipe.save_pretrained(folder)
    shutil.rmtree(folder / "clip-vocab")
    log(f"pipeline: {folder}")


# 3-4. Training runs through `python -m train`.

def train(run: Path, data: Path, pipeline: Path, *extra: str) -> None:
    if (run / "done").is_file():
        return
    args = ["+experiment=finetune_flux", "data=captions", f"data.path={data}", "data.vae=pixels", "data.channels=1",
            "data.resolution=32", "data.alignment=16", "data.aspect_ratios=[1.0]", "data.max_sequence_length=8",
            f"finetune.pretrained={pipeline}", "finetune.dtype=fp32", "finetune.gradient_checkpointing=false",
            "trainer.mixed_precision=no", "trainer.cpu=true", "trainer.sample_every=0", "trainer.log_every=25",
            "trainer.log_with=none", "trainer.keep_checkpoints=1", "resume=auto", f"run_dir={run}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    began = time.time()
    result = subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"training {run} failed:\n{result.stderr[-3000:]}")
    (run / "done").write_text(f"{time.time() - began:.1f}\n")
    log(f"trained {run.name} in {time.time() - began:.0f} s")


def train_seconds(run: Path) -> tuple[float, int]:
    """(seconds of training, steps) from metrics.jsonl: the trainer's clock at the last logged step."""
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    return last["seconds"], last["step"]


def export_pretrained(run: Path, base: Path, out: Path) -> None:
    """The pre-training run's EMA transformer, as the transformer of a copy of the base pipeline."""
    from train.build import pretrained_of
    from train.checkpoint import load_run

    if (out / "model_index.json").is_file():
        return
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("transformer"))
    pretrained_of(load_run(run).net).save_pretrained(out / "transformer")


# 5. Scores.

class Scorer:
    def __init__(self, cache_dir: str):
        from train.data.fashion_mnist import fashion_mnist
        from train.metrics.classifier import features, load_or_train

        train, test = fashion_mnist(split="train"), fashion_mnist(split="test")
        self.classifier, self.meta = load_or_train(train, None, cache_dir, test)
        g = torch.Generator().manual_seed(0)
        keep = torch.isin(test.labels, torch.tensor(list(LORA_CLASSES)))
        test_x = test.images[keep][torch.randperm(int(keep.sum()), generator=g)[:1000]]
        self.real = features(self.classifier, test_x)
        keep = torch.isin(train.labels, torch.tensor(list(LORA_CLASSES)))
        pick = torch.randperm(int(keep.sum()), generator=g)[: 10 * SETTINGS["per_attr"]]  # as many as the samples
        self.floor = self.score(train.images[keep][pick], train.labels[keep][pick])

    def score(self, samples: torch.Tensor, labels: torch.Tensor) -> dict:
        from train.metrics.classifier import sample_scores

        return sample_scores(self.classifier, samples.clamp(-1, 1), labels, self.real)


SETTINGS = {"per_attr": 10, "sample_steps": 16}  # --per-attr, --sample-steps: 100 samples, 16 Euler steps


def sample_run(net, cfg, objective, captions: list[str], seed: int = 0, per_attr: int | None = None, route_ratio: float = 0.0):
    """Samples of classes 5-9 (both attributes), their class labels (5..9) and the caption rows asked for."""
    from edm import generate
    from train.build import sampling_objective

    per_attr = per_attr or SETTINGS["per_attr"]
    rows, classes = [], []
    for c in LORA_CLASSES:
        for attr in ("small", "large"):
            rows += [captions.index(f"a {NAMES[c]} {attr}")] * per_attr
            classes += [c] * per_attr
    rows, shape = torch.tensor(rows), (1, 32, 32)
    obj = sampling_objective(cfg, objective, net.model, shape)
    x = generate(net, rows, shape=shape, steps=SETTINGS["sample_steps"], guidance=1.0, seed=seed, device="cpu", sampler="euler",
                 null_label=len(captions), objective=obj, router=net.model.router, route_ratio=route_ratio)
    return x, torch.tensor(classes)


def score_run(run: Path, scorer: Scorer) -> dict:
    from train.checkpoint import load_run

    out = run / "score.json"
    if out.is_file():
        return json.loads(out.read_text())
    loaded = load_run(run)
    x, classes = sample_run(loaded.net, loaded.cfg, loaded.objective, loaded.dataset.captions)
    seconds, steps = train_seconds(run)
    result = {**scorer.score(x, classes), "train_seconds": seconds, "steps": steps}
    torch.save(x[:: SETTINGS["per_attr"]].clone(), run / "grid.pt")  # 10 samples: one per (class, attribute)
    out.write_text(json.dumps(result) + "\n")
    return result


def score_base(pretrained: Path, lora_run: Path, scorer: Scorer, work: Path) -> dict:
    """The pretrained model without LoRA, conditioned on the LoRA set's captions."""
    from backbones.adapters import PromptConditioned, adapt, load_pretrained
    from edm import Flow
    from train.checkpoint import load_run

    out = work / "base-score.json"
    if out.is_file():
        return json.loads(out.read_text())
    loaded = load_run(lora_run)  # for its config and its caption table
    table = loaded.dataset.prompt_table()
    net = Flow().wrap(PromptConditioned(adapt(load_pretrained("flux", pretrained)), table.tensors).eval())
    x, classes = sample_run(net, loaded.cfg, loaded.objective, loaded.dataset.captions)
    result = scorer.score(x, classes)
    out.write_text(json.dumps(result) + "\n")
    return result


def routed_sampling(work: Path, out: Path, scorer: Scorer, seeds) -> None:
    """Step 7: the equal-step routed runs, sampled with their routes forced at 0.5."""
    from train.checkpoint import load_run

    if (out / "routed_sampling.json").is_file():
        return
    runs = {}
    for name in POLICIES[1:]:
        runs[name] = []
        for s in seeds:
            loaded = load_run(work / "runs" / "lora" / f"{name}-steps-s{s}")
            x, classes = sample_run(loaded.net, loaded.cfg, loaded.objective, loaded.dataset.captions, route_ratio=0.5)
            runs[name].append(scorer.score(x, classes))
    what = ("the equal-step routed LoRA runs sampled with routing forced at 0.5 over their trained routes (train.sample "
            "--route-ratio 0.5); same samples, steps, seed and scorer as results.json")
    (out / "routed_sampling.json").write_text(json.dumps({"what": what, "runs": runs}, indent=1) + "\n")


# 6. Report.

def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return float(v.mean()), float("nan")
    return float(v.mean()), float(stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))


def grids(work: Path, out: Path, seeds) -> None:
    from torchvision.utils import save_image

    rows = []
    for name in POLICIES:
        rows.append(torch.load(work / "runs" / "lora" / f"{name}-steps-s0" / "grid.pt"))
    images = ((torch.cat(rows) + 1) / 2).clamp(0, 1)
    images = torch.nn.functional.interpolate(images, scale_factor=2, mode="nearest")
    save_image(images, out / "samples.png", nrow=10, padding=2, pad_value=1.0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/tread-lora")
    p.add_argument("--out", default="docs/figures/tread_lora")
    p.add_argument("--per-class", type=int, default=300)
    p.add_argument("--pretrain-steps", type=int, default=2000)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--per-attr", type=int, default=SETTINGS["per_attr"], help="samples per (class, attribute) when scoring")
    p.add_argument("--sample-steps", type=int, default=SETTINGS["sample_steps"], help="Euler steps of each scored sample")
    p.add_argument("--classifier-cache", default=os.path.expanduser("~/.cache/tread-zoo"))
    args = p.parse_args(argv)
    SETTINGS.update(per_attr=args.per_attr, sample_steps=args.sample_steps)
    torch.set_num_threads(1)
    work, out = Path(args.work).resolve(), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    write_folders(work, args.per_class)
    write_pipeline(work / "base")
    train(work / "runs" / "pretrain", work / "data" / "pretrain", work / "base", "finetune.train=full", "routing=none", "routing.routes=[]",
          "trainer.lr=1e-3", "trainer.batch_size=32", f"trainer.max_steps={args.pretrain_steps}", "trainer.grad_clip=1.0",
          f"trainer.ckpt_every={args.pretrain_steps}")
    export_pretrained(work / "runs" / "pretrain", work / "base", work / "pretrained")

    lora = ["finetune.train=lora", "finetune.lora.rank=16", "finetune.lora.alpha=16", "trainer.lr=1e-3", "trainer.batch_size=16"]
    routing = {"none": ["routing=none", "routing.routes=[]"], "random": ["routing=random", ROUTE],
               "structured": ["routing=structured", ROUTE]}
    seeds = range(args.seeds)
    for seed in seeds:  # equal steps: seeds outermost, so every policy has seed 0 early
        for name in POLICIES:
            train(work / "runs" / "lora" / f"{name}-steps-s{seed}", work / "data" / "lora", work / "pretrained", *lora, *routing[name], f"seed={seed}",
                  f"trainer.max_steps={args.steps}", f"trainer.ckpt_every={args.steps}")
    per_step = {name: float(np.median([train_seconds(work / "runs" / "lora" / f"{name}-steps-s{s}")[0] / args.steps for s in seeds]))
                for name in POLICIES}
    budget = {name: round(args.steps * per_step["none"] / per_step[name]) for name in POLICIES}
    log(f"median seconds per step {per_step}; equal wall-clock step budgets {budget}")
    for seed in seeds:
        for name in POLICIES[1:]:
            train(work / "runs" / "lora" / f"{name}-time-s{seed}", work / "data" / "lora", work / "pretrained", *lora, *routing[name], f"seed={seed}",
                  f"trainer.max_steps={budget[name]}", f"trainer.ckpt_every={budget[name]}")

    scorer = Scorer(args.classifier_cache)
    base = score_base(work / "pretrained", work / "runs" / "lora" / "none-steps-s0", scorer, work)
    runs = {}
    for kind in ("steps", "time"):
        for name in POLICIES:
            source = "steps" if name == "none" else kind  # the dense run is the reference of both comparisons
            runs[f"{name}-{kind}"] = [score_run(work / "runs" / "lora" / f"{name}-{source}-s{s}", scorer) for s in seeds]
            log(f"scored {name}-{kind}: {[round(r['classifier_fd'], 2) for r in runs[f'{name}-{kind}']]}")
    summary = {}
    for key, results in runs.items():
        dense = runs[f"none-{key.split('-')[1]}"]
        summary[key] = {m: {"mean_ci95": interval([r[m] for r in results]),
                            "minus_none_paired_ci95": interval([r[m] - d[m] for r, d in zip(results, dense)])}
                        for m in ("classifier_fd", "class_accuracy", "train_seconds", "steps")}
    report = {"command": " ".join(["OMP_NUM_THREADS=1", "python", "docs/figures/tread_lora_evidence.py", *(argv or sys.argv[1:])]),
              "machine": "2-core Intel Xeon KVM CPU (shared), torch " + torch.__version__ + ", one thread per run",
              "settings": vars(args), "median_seconds_per_step": per_step, "equal_time_steps": budget,
              "classifier": {k: scorer.meta[k] for k in ("dataset", "heldout_accuracy", "accuracy_on")},
              "floor_real_train_images": scorer.floor, "pretrained_without_lora": base, "runs": runs, "summary": summary}
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    grids(work, out, seeds)
    routed_sampling(work, out, scorer, seeds)
    log(f"wrote {out / 'results.json'}, {out / 'routed_sampling.json'} and {out / 'samples.png'}")


if __name__ == "__main__":
    main()
