"""TREAD_SCAN_BACKEND and TREAD_SCAN_CHUNK are checked once when a command starts (backbones/ops/
selective_scan_env.py): a bad value is one sentence and exit 2 before anything is built, a value that does nothing on
this machine one line. Two cases run the real `python -m train`; the rest call the check in-process."""

from __future__ import annotations

import pytest

from backbones.ops.selective_scan_env import check_scan_environment
from conftest import run_module
from routing import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("TREAD_SCAN_BACKEND", "TREAD_SCAN_CHUNK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a user's machine: the Triton scan needs a GPU


@pytest.mark.parametrize("env, words", [
    ({"TREAD_SCAN_BACKEND": "bogus"}, "TREAD_SCAN_BACKEND='bogus' is not a selective scan backend; use one of auto, "),
    ({"TREAD_SCAN_BACKEND": "TRITON"}, "TREAD_SCAN_BACKEND='TRITON' is not a selective scan backend (names are lower "
                                       "case: triton)"),
    ({"TREAD_SCAN_BACKEND": "mamba_ssm"}, "TREAD_SCAN_BACKEND=mamba_ssm needs a CUDA GPU and this machine has none"),
    ({"TREAD_SCAN_BACKEND": "triton"}, "TREAD_SCAN_BACKEND=triton needs a CUDA GPU and this machine has none"),
    ({"TREAD_SCAN_CHUNK": "7"}, "TREAD_SCAN_CHUNK='7' is not a chunk length the selective scan takes; use one of 16,"),
    ({"TREAD_SCAN_CHUNK": "abc"}, "TREAD_SCAN_CHUNK='abc' is not a chunk length"),
    ({"TREAD_SSD_BACKEND": "mamba"}, "TREAD_SSD_BACKEND must be one of"),
    ({"TREAD_SSD_BACKEND": "fla"}, "TREAD_SSD_BACKEND=fla needs CUDA tensors"),
])
def test_bad_values_are_refused_in_one_sentence(monkeypatch, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        check_scan_environment(cuda=False)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_mamba_ssm_on_a_gpu_without_the_package(monkeypatch):
    from backbones.ops import cuda_kernels

    monkeypatch.setenv("TREAD_SCAN_BACKEND", "mamba_ssm")
    monkeypatch.setattr(cuda_kernels, "cuda_selective_scan", lambda: None)
    with pytest.raises(ConfigError, match=r"^TREAD_SCAN_BACKEND=mamba_ssm: backend='mamba_ssm' needs CUDA tensors and "
                                          r"mamba-ssm .*; unset it for auto\.$"):
        check_scan_environment(cuda=True)


def test_a_chunk_without_the_triton_scan_is_named(monkeypatch):
    monkeypatch.setenv("TREAD_SCAN_CHUNK", "64")
    assert check_scan_environment(cuda=False) == [
        "note: TREAD_SCAN_CHUNK=64 does nothing here: it sets the Triton scan's chunk, and this run's selective scan "
        "is torch (no CUDA GPU)."]
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "torch")
    assert "(TREAD_SCAN_BACKEND=torch)" in check_scan_environment(cuda=True)[0]
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "triton")
    assert check_scan_environment(cuda=True) == []  # the Triton scan runs: the chunk applies
    monkeypatch.delenv("TREAD_SCAN_CHUNK")
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "auto")
    assert check_scan_environment(cuda=False) == []


@pytest.mark.parametrize("env, line", [
    ({"TREAD_SCAN_BACKEND": "bogus"}, "error: TREAD_SCAN_BACKEND='bogus' is not a selective scan backend; use one of "),
    # The chunk's sentence is the in-process check's (above); its process run with -m slow.
    pytest.param({"TREAD_SCAN_CHUNK": "abc"}, "error: TREAD_SCAN_CHUNK='abc' is not a chunk length the selective scan takes; ",
                 marks=pytest.mark.slow),
])
def test_python_m_train_refuses_before_any_work(tmp_path, env, line):
    run = tmp_path / "run"
    result = run_module("train", "backbone=mamba", f"run_dir={run}", "trainer.max_steps=1",
                        env={**env, "TRITON_INTERPRET": "0"}, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), result.stderr
    assert not run.exists()
