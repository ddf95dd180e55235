"""The trainer's images/s against the bare training step, in one process on one machine.

    python -m train.bench.trainer_speed [--batch 64] [--rounds 5] [--steps 10] [key=value ...]

The trainer is the default config (the tiny DiT on digits; extra `key=value` overrides as `python -m train` takes
them) running its loop's step: `train_step` between logging steps, with the host read of the losses at the end of
each round, as `fit` reads at a logging step. The bare step (train.bench.timing.training_step, what
train.bench.routing times) is forward, backward and AdamW on fixed data with the same network and batch. Rounds of
each alternate, so load from other jobs on a shared machine falls on both; each side's rate is the median over
rounds of batch x steps / time, where time is wall-clock time, or with `--threads 1` on a CPU the process's CPU
time (train.bench.timing.step_clock: on a shared machine it leaves out the time spent waiting for a core). Prints
the ratio trainer / bare: a ratio from one run, not a test.
"""

from __future__ import annotations

import copy
import statistics
import tempfile

import torch

from train.bench.spread import spread
from train.bench.timing import step_clock, training_step
from train.cli import ArgumentParser, bounded, friendly_errors, precompose


def compose_training(overrides: list[str]):
    """The training config of these overrides, checked as `python -m train` checks it: a bad key, value or data
    folder is one sentence and exit code 2, before any work (train/cli.py)."""
    return precompose("config", overrides)


@friendly_errors  # what the trainer refuses once built (a checkpoint, a data file): one sentence
def main(argv=None) -> dict:
    p = ArgumentParser(prog="python -m train.bench.trainer_speed", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=bounded(int, 1, example="--batch 64"), default=64)
    p.add_argument("--rounds", type=bounded(int, 1, example="--rounds 5"), default=5)
    p.add_argument("--steps", type=bounded(int, 1, example="--steps 10"), default=10,
                   help="steps per round (the trainer reads the device once per round)")
    p.add_argument("--warmup", type=bounded(int, 0, example="--warmup 3"), default=3, help="steps of each before timing")
    p.add_argument("--threads", type=bounded(int, 1, example="--threads 2"), default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("overrides", nargs="*", help="training config overrides, e.g. routing=random backbone=rwkv")
    args = p.parse_args(argv)
    if any(arg.startswith("-") for arg in args.overrides):
        p.error(f"{next(a for a in args.overrides if a.startswith('-'))} is not a flag of this command; training settings "
                "are key=value overrides (e.g. routing=random)")
    if args.threads:
        torch.set_num_threads(args.threads)
    from train.trainer import Trainer

    total = args.warmup + args.rounds * args.steps
    with tempfile.TemporaryDirectory(prefix="trainer_speed_") as tmp:
        cfg = compose_training([f"trainer.batch_size={args.batch}", f"trainer.max_steps={total}", f"trainer.log_every={args.steps}",
                                "trainer.sample_every=0", "trainer.ckpt_every=0", "trainer.log_with=none", f"run_dir={tmp}/run",
                                *args.overrides])
        trainer = Trainer(cfg)
        device = trainer.acc.device
        net = copy.deepcopy(trainer.acc.unwrap_model(trainer.net)).train()  # the same network and weights, its own AdamW
        router = net.model.router
        draws = torch.Generator(device=device)
        shape = tuple(trainer.dataset.shape)
        bare_step = training_step(net, args.batch, shape, trainer.dataset.num_classes, device)
        calls = iter(range(10**9))

        def bare():
            if router.routes:  # the routes of a step drawn before its forward, as the trainer draws them
                router.set_draws(draws.manual_seed(next(calls)), 0, args.batch)
            bare_step()

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def trainer_round(steps: int) -> None:
            trainer.in_loop = True  # as inside fit: steps between logging steps leave their losses on the device
            for _ in range(steps):
                trainer.train_step()
            trainer._read()  # the logging step's read waits for the round
            trainer.in_loop = False

        def bare_round(steps: int) -> None:
            for _ in range(steps):
                bare()
            sync()

        clock, clock_name = step_clock(device, args.threads)
        trainer_round(args.warmup)
        bare_round(args.warmup)
        rates = {"trainer": [], "bare": []}
        for _ in range(args.rounds):
            for name, run in (("trainer", trainer_round), ("bare", bare_round)):
                tic = clock()
                run(args.steps)
                rates[name].append(args.batch * args.steps / (clock() - tic))
        trainer.logger.close()
        trainer._release_run_dir()
    median = {k: statistics.median(v) for k, v in rates.items()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, threads={torch.get_num_threads()}"
    model = f"{cfg.backbone.name}-{cfg.backbone.preset}/{cfg.backbone.patch_size}, routing={cfg.routing.policy}, data={cfg.data.name}"
    print(f"{model} | batch {args.batch} | {where} | {args.rounds} rounds of {args.steps} steps, {clock_name} | torch {torch.__version__}")
    # A round of each ran back to back, so each round's own ratio is meaningful: their range is the spread.
    ratios = spread([t / b for t, b in zip(rates["trainer"], rates["bare"])])
    print(f"trainer {median['trainer']:.1f} images/s, bare step {median['bare']:.1f} images/s: "
          f"trainer / bare = {median['trainer'] / median['bare']:.3f} (rounds {ratios['low']:.3f}-{ratios['high']:.3f})")
    return {"trainer_images_per_s": median["trainer"], "bare_images_per_s": median["bare"],
            "ratio": median["trainer"] / median["bare"], "ratio_spread": ratios, "rounds": rates}


if __name__ == "__main__":
    main()
