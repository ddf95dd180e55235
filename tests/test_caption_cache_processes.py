"""A captioned folder's cache under several processes (`accelerate launch`, two gloo processes on the CPU): the main
process stages the new cache files outside the data folder and the other process reads them there, so a run refused
after the encoding leaves the data folder as it was, and a run that starts publishes the cache with its first writes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, folder_hash
from test_captions import overrides, pipeline, write_images  # noqa: F401  (pipeline: the tiny Flux fixture)


def launch_two(tmp_path, args: list[str], port: int) -> subprocess.CompletedProcess:
    """`accelerate launch` of `python -m train` on two CPU processes, with a temporary folder of its own."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port), "-m", "train", *args]
    return subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp"), "HYDRA_FULL_ERROR": "0"})


@pytest.mark.slow
def test_two_processes_refused_after_the_encoding_leave_the_data_folder_as_it_was(pipeline, tmp_path):  # noqa: F811
    """resume=true in a fresh run folder is refused after the cache is encoded (the checkpoint is looked for last)."""
    data = write_images(tmp_path / "data")
    before = folder_hash(data)
    out = launch_two(tmp_path, [*overrides(pipeline, data, tmp_path / "run"), "trainer.log_with=none", "resume=true"], 29571)
    assert out.returncode != 0 and "holds no checkpoint" in out.stderr, out.stderr[-3000:]
    assert "data=captions: encoding" in out.stdout, out.stdout[-2000:]  # the refusal came after the encoding
    assert folder_hash(data) == before and not (data / ".tread_cache").exists()
    assert not list((tmp_path / "tmp").glob("tread_cache-*")), "the staging folder is removed"


@pytest.mark.slow
def test_two_processes_train_from_the_staged_cache_and_publish_it(pipeline, tmp_path):  # noqa: F811
    data = write_images(tmp_path / "data")
    out = launch_two(tmp_path, [*overrides(pipeline, data, tmp_path / "run"), "trainer.log_with=none"], 29572)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 process(es)" in out.stdout and "data.cache: wrote" in out.stdout, out.stdout[-2000:]
    assert (data / ".tread_cache" / "manifest.json").is_file()
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2  # steps 1 and 2
    assert not list((tmp_path / "tmp").glob("tread_cache-*"))
