"""The op and step benches refuse each bad argument as train.bench.gpu does: one sentence, exit code 2, before any
work and without writing anything."""

import importlib

import pytest
import torch

NO_GPU = not torch.cuda.is_available()

CASES = [
    ("routing", ["--policy", "none"], "invalid choice: 'none'"),
    ("routing", ["--policy", "bogus"], "invalid choice: 'bogus'"),
    ("routing", ["--batch", "0"], "--batch: 0 is out of range"),
    ("routing", ["--presets", "Z"], "--presets Z: dit has no such preset"),
    ("routing", ["--repeats", "0"], "--repeats: 0 is out of range"),
    ("routing", ["--input-size", "31"], "--input-size 31 is not a multiple of --patch 2"),
    ("routing", ["--backbone", "rwkv", "--presets", "XL"], "--presets XL: rwkv has no such preset"),
    ("scan", ["--length", "0"], "--length: 0 is out of range"),
    ("scan", ["--repeats", "x"], "'x' is not an integer"),
    ("wkv", ["--T", "-1"], "--T: -1 is out of range"),
    ("wkv", ["--chunk-len", "0"], "--chunk-len: 0 is out of range"),
    ("moe", ["/no/such/run"], "checkpoint '/no/such/run' does not exist"),
    ("moe", [".", "--steps", "0"], "--steps: 0 is out of range"),
    ("sampling", ["/no/such/run"], "run '/no/such/run' does not exist"),
    ("sampling", [".", "--steps", "0"], "--steps: 0 is out of range"),
    ("finetune", ["--batch", "0"], "--batch: 0 is out of range"),
    ("finetune", ["--policy", "none"], "invalid choice: 'none'"),
    ("finetune", ["--ratio", "1.5"], "--ratio: 1.5 is out of range"),
    ("official", ["--tread", ".", "--batch", "0"], "--batch: 0 is out of range"),
    ("official", ["--tread", ".", "--repeats", "0"], "--repeats: 0 is out of range"),
    ("trainer_speed", ["--rounds", "0"], "--rounds: 0 is out of range"),
    ("trainer_speed", ["trainer.lr=fast"], "trainer.lr"),
    ("presets", ["--latent", "31"], "--latent 31 is not a multiple of --patch 2"),
    ("presets", ["--classes", "0"], "--classes: 0 is out of range"),
]
if NO_GPU:
    CASES += [(bench, ["--tread", "."] * (bench == "official") + ["--device", "cuda"], "--device: cuda but this machine has no visible CUDA GPU")
              for bench in ("routing", "scan", "wkv", "finetune", "official")]


@pytest.mark.parametrize("bench,argv,says", CASES, ids=[f"{b}:{' '.join(a)}" for b, a, _ in CASES])
def test_a_bad_bench_argument_is_one_sentence_and_exit_2(bench, argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing may be written here
    main = importlib.import_module(f"train.bench.{bench}").main
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    out, err = capsys.readouterr()
    assert stopped.value.code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert out == ""
    assert list(tmp_path.iterdir()) == []


def test_a_folder_for_an_output_that_is_a_file_is_refused(tmp_path, capsys):
    from train.bench.sampling import main

    (tmp_path / "out").write_text("a file")
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path), "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "out").read_text() == "a file"



@pytest.mark.parametrize("bench,argv", [("routing", []), ("scan", []), ("gpu", ["--dry-run"])])
def test_a_bad_scan_switch_is_one_sentence_before_any_work(bench, argv, tmp_path, monkeypatch, capsys):
    # The benches that may run the selective scan check TREAD_SCAN_BACKEND as python -m train does (issue 50, item 3).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREAD_SCAN_BACKEND", "TRITON")
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(f"train.bench.{bench}").main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert stopped.value.code == 2 and out == "" and list(tmp_path.iterdir()) == []
    assert len(lines) == 1 and "TREAD_SCAN_BACKEND='TRITON' is not a selective scan backend" in lines[0], err
