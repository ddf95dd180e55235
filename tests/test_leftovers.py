"""What a kill or a second process could leave or repeat: the temporary files of a killed write are removed at the next
start, the bench's scoring classifier is trained by one process at a time, and a long sample.prompts file is cut to a
preview's rows in one line."""

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from omegaconf import OmegaConf

from train.bench.claims import waiting_claim
from train.data import validation_prompts
from conftest import FAST, run_cli


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_writes_temporary_files_are_removed_at_the_next_start(tmp_path):
    run = tmp_path / "run"
    first = run_cli("train", *FAST, "trainer.ckpt_every=2", f"run_dir={run}")
    assert first.returncode == 0, first.stderr
    # As a kill while resume trims metrics.jsonl, or while Hydra's record or a grid is written, leaves them.
    dead = dead_pid()
    left = [run / f".metrics.jsonl.{dead}.tmp", run / ".hydra" / f".config.yaml.{dead}.tmp",
            run / "samples" / f".step_0000002.png.{dead}.tmp"]
    live = run / ".notes.txt.1.tmp"  # a live process's (pid 1's) write in progress stays
    for path in [*left, live]:
        path.parent.mkdir(exist_ok=True)
        path.write_text("cut")
    resumed = run_cli("train", *FAST, "trainer.max_steps=3", "trainer.ckpt_every=2", f"run_dir={run}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    said = [ln for ln in resumed.stdout.splitlines() if "left by an interrupted write" in ln]
    assert said == [f"run_dir: removed {p.relative_to(run)} (left by an interrupted write)" for p in left]
    assert not any(p.exists() for p in left) and live.read_text() == "cut"


def test_the_classifier_claim_waits_for_the_process_that_holds_it(tmp_path):
    path = tmp_path / "classifier-digits-8px.safetensors.claim"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    path.write_text(str(holder.pid))
    threading.Thread(target=holder.wait, daemon=True).start()  # reaped once it ends, so its pid is gone
    lines = []
    with waiting_claim(path, log=lines.append, poll_s=0.05):
        assert holder.poll() is not None  # entered only once the holder had finished
        assert path.read_text() == str(os.getpid())
    assert lines == [f"waiting for pid {holder.pid}, which holds {path}; it trains what this process would load"]
    assert not path.exists()
    with waiting_claim(path, log=lines.append):  # free: held at once, nothing said
        pass
    assert len(lines) == 1


def test_a_long_prompts_file_is_cut_to_the_previews_rows_in_one_line(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(3000)))
    before = prompts.read_bytes()
    cfg = OmegaConf.create({"sample": {"prompts": str(prompts)}, "finetune": {"family": "flux", "dtype": "fp32"}})
    encoded = []
    monkeypatch.setattr(validation_prompts, "text_pipeline", lambda cfg: tmp_path / "pipe")
    monkeypatch.setattr(validation_prompts, "encode_table", lambda family, folder, texts, **kw: encoded.append(texts) or "table")
    lines = []
    model = type("Conditioned", (), {"encoder_hidden_states": None})()
    assert validation_prompts.encode_validation(cfg, model, "cpu", log=lines.append) == "table"
    n = validation_prompts.PREVIEW_PROMPTS
    assert encoded == [[f"prompt {i}" for i in range(n)]]
    assert lines[0] == (f"sample.prompts: 3000 prompts; the previews show the first {n}, one row each "
                        "(python -m train.sample --prompts-file samples them all)")
    assert prompts.read_bytes() == before


def snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_captioned_folder_receives_its_cache_only_once_every_check_passed(tmp_path):
    from tiny_pipelines import flux_pipeline, tiny_vae
    from test_captions import overrides, write_images

    flux_pipeline(tmp_path / "flux", vae=tiny_vae(latent_channels=4), in_channels=16, num_layers=2).save_pretrained(tmp_path / "pipe")
    data = write_images(tmp_path / "data")
    before = snapshot(data)
    # Refused after the captions were encoded (no checkpoint to resume): the data folder is as it was.
    refused = run_cli("train", *overrides(tmp_path / "pipe", data, tmp_path / "run"), "resume=true")
    errors = [ln for ln in refused.stderr.replace("\r", "\n").splitlines() if ln.startswith("error:")]  # less the loaders' bars
    assert refused.returncode == 2 and len(errors) == 1 and "holds no checkpoint" in errors[0], refused.stderr
    assert "Traceback" not in refused.stderr
    assert snapshot(data) == before and not (tmp_path / "run").exists()
    # Accepted: the cache is written into the data folder at the first writes, said in one line, and trained from.
    ran = run_cli("train", *overrides(tmp_path / "pipe", data, tmp_path / "run"))
    assert ran.returncode == 0, ran.stderr
    cache = data / ".tread_cache"
    said = [ln for ln in ran.stdout.splitlines() if ln.startswith("data.cache:")]
    assert said == [f"data.cache: wrote {', '.join(sorted(p.name for p in cache.iterdir() if p.name != 'manifest.json'))}, "
                    f"manifest.json into {cache}"]
    # A kill left a cache write's and a staging folder's temporary files: the next run that writes removes them.
    dead = dead_pid()
    left = [cache / f".latents-32x32.safetensors.{dead}", cache / f".manifest.json.{dead}.tmp"]
    for path in left:
        path.write_text("cut")
    stage = Path(tempfile.gettempdir()) / f"tread_cache-{dead}-test"
    stage.mkdir()
    (data / "wide" / "d.txt").write_text("a tall blue disk")
    again = run_cli("train", *overrides(tmp_path / "pipe", data, tmp_path / "run2"))
    assert again.returncode == 0, again.stderr
    assert [ln for ln in again.stdout.splitlines() if ln.startswith("data.cache:")] == [
        f"data.cache: wrote text.safetensors, manifest.json into {cache}"]  # the images did not change
    assert not any(p.exists() for p in left) and not stage.exists()
    assert not list(Path(tempfile.gettempdir()).glob(f"tread_cache-{os.getpid()}-*"))  # this process's stages are gone
