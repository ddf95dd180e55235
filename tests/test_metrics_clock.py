"""The clocks of metrics.jsonl: `images_per_s` times training steps only (a preview grid drawn between two reads
is not in it), and `seconds` goes on across a resume instead of starting again at 0."""

import json
import time

from train.trainer import Trainer
from conftest import FAST, compose_cfg


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_preview_is_not_timed_as_training_and_the_clock_goes_on_after_a_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "sample_grid", lambda self: time.sleep(1.0))  # a preview that takes a second
    run = tmp_path / "run"
    common = [*FAST, "backbone.depth=2", "trainer.sample_every=1", "trainer.ckpt_every=2", "trainer.log_with=none", f"run_dir={run}"]
    Trainer(compose_cfg(*common, "trainer.max_steps=3")).fit()
    # Steps 2 and 3 follow a preview: timed with it, they would read at most 4 images (a batch) per second.
    assert all(m["images_per_s"] > 16 for m in metrics(run)), metrics(run)
    Trainer(compose_cfg(*common, "trainer.max_steps=4", "resume=true")).fit()  # from the last checkpoint, step 3
    seconds = [m["seconds"] for m in metrics(run)]
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4] and seconds == sorted(seconds), seconds


def test_the_progress_bars_rate_leaves_a_preview_out(tmp_path, monkeypatch):
    """The bar's s/it (tqdm's rate) and elapsed time after a preview time the steps only, as images_per_s does: two
    one-second previews timed with the steps would show 2 s elapsed at the third (the last step's) and pull the rate
    below 3 steps per second."""
    import train.trainer.loop as loop

    bars, shown = [], []

    class Recorded(loop.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    def preview(self):
        shown.append(bars[0].format_dict)  # what the bar shows as the preview starts
        time.sleep(1.0)

    monkeypatch.setattr(loop, "tqdm", Recorded)
    monkeypatch.setattr(Trainer, "sample_grid", preview)
    cfg = [*FAST, "backbone.depth=2", "trainer.sample_every=2", "trainer.log_with=none", f"run_dir={tmp_path / 'run'}"]
    Trainer(compose_cfg(*cfg, "trainer.max_steps=6")).fit()
    last = shown[-1]  # at step 6, after the previews of steps 2 and 4
    rate = last["rate"] or (last["n"] - last["initial"]) / last["elapsed"]  # tqdm's moving average, else n / elapsed
    assert len(shown) == 3 and last["n"] == 6 and last["elapsed"] < 2 and rate > 3, last
