"""FID pipeline end to end with a randomly initialised Inception-v3 loaded from a local file.

Inception at its 299 x 299 input costs about a second per image on the 2-core CPU, so one test
runs the real input size and the pipeline tests shrink the network's input resize to 107 x 107
(same layers and weights, a ninth of the work; the global pool makes any size >= 75 valid).
"""

import json

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from PIL import Image

from routing.errors import ConfigError
from train.fid import main as fid_main
from train.metrics.fid import compute_fid
from train.metrics.inception import WEIGHTS_URL, inception_features, load_inception, resolve_weights


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory):
    """State dict of torch-fidelity's Inception-v3 architecture with random weights, saved to a file."""
    import torch_fidelity.feature_extractor_inceptionv3 as module

    # Construct the network without its download: skip the URL fetch and the state-dict load once.
    patch = pytest.MonkeyPatch()
    patch.setattr(module, "load_state_dict_from_url", lambda *args, **kwargs: {})
    patch.setattr(module.FeatureExtractorInceptionV3, "load_state_dict", lambda self, *args, **kwargs: None)
    torch.manual_seed(0)
    net = module.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    patch.undo()
    # He initialisation keeps activations O(1) through the 40-odd layers, so features are not ~1e-8.
    for layer in net.modules():
        if isinstance(layer, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
    path = tmp_path_factory.mktemp("inception") / "inception-random.pth"
    torch.save(net.state_dict(), path)
    return path


@pytest.fixture
def small_input(monkeypatch):
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    monkeypatch.setattr(FeatureExtractorInceptionV3, "INPUT_IMAGE_SIZE", 107)


def image_folder(path, seed, brightness):
    path.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(3):
        pixels = (rng.random((16, 16, 3)) * brightness).astype(np.uint8)
        Image.fromarray(pixels).save(path / f"{i}.png")
    return path


def test_missing_weights_name_the_download_and_destination(tmp_path):
    with pytest.raises(ConfigError, match="download https://.*weights-inception-2015-12-05"):
        resolve_weights(tmp_path / "nothing.pth")
    assert WEIGHTS_URL.endswith("weights-inception-2015-12-05-6726825d.pth")


def test_wrong_weights_file_is_a_clear_error(tmp_path):
    torch.save({"fc.weight": torch.zeros(2, 2)}, tmp_path / "wrong.pth")
    with pytest.raises(ConfigError, match="not torch-fidelity's Inception-v3 weights"):
        load_inception(tmp_path / "wrong.pth")


def test_features_at_full_input_size(inception_weights):
    model = load_inception(inception_weights)
    images = torch.rand(1, 3, 20, 20)
    features = inception_features(model, images)
    assert features.shape == (1, 2048) and features.dtype == torch.float32
    assert torch.isfinite(features).all() and features.abs().sum() > 0
    # Float images in [0, 1] are quantised exactly like uint8 images.
    torch.testing.assert_close(features, inception_features(model, (images * 255).round().to(torch.uint8)))


def test_folder_fid_cli(inception_weights, small_input, tmp_path):
    bright = image_folder(tmp_path / "bright", seed=0, brightness=255)
    dark = image_folder(tmp_path / "dark", seed=1, brightness=90)
    common = ["--inception", str(inception_weights), "--batch-size", "3"]

    # FID of a folder with itself is ~0 (to the rounding of square roots of a rank-2 covariance).
    same = fid_main(["--images", str(bright), "--ref", str(bright), "--out", str(tmp_path / "fid.json"), *common])
    assert abs(same) < 1e-3
    assert json.loads((tmp_path / "fid.json").read_text())["fid"] == same

    # Saved reference statistics (ADM's `mu`, `sigma` keys) score another folder: finite and clearly positive.
    fid_main(["--images", str(bright), "--save-stats", str(tmp_path / "ref.npz"), *common])
    with np.load(tmp_path / "ref.npz") as ref:
        assert ref["mu"].shape == (2048,) and ref["sigma"].shape == (2048, 2048)
    different = fid_main(["--images", str(dark), "--ref", str(tmp_path / "ref.npz"), *common])
    assert np.isfinite(different) and different > 1000 * abs(same)


class GaussianDenoiser(torch.nn.Module):
    """The exact denoiser for data ~ N(0, sigma_data^2): D(x; sigma) = x sigma_data^2 / (sigma^2 + sigma_data^2)."""

    sigma_data = 0.5

    def forward(self, x, sigma, class_labels=None):
        sigma = torch.as_tensor(sigma, dtype=x.dtype).reshape(-1, 1, 1, 1)  # (B,) -> (B, 1, 1, 1)
        return x * self.sigma_data**2 / (sigma**2 + self.sigma_data**2)


class PixelDataset:
    num_classes = 2
    shape = (3, 8, 8)

    def to_images(self, x):
        return (x + 0.5).clamp(0, 1)


def test_compute_fid_from_a_denoiser(inception_weights, small_input, tmp_path):
    real = image_folder(tmp_path / "real", seed=2, brightness=255)
    cfg = {"ref": str(real), "num_samples": 4, "steps": 3, "batch_size": 3, "inception": str(inception_weights), "every": 100}
    fid = compute_fid(GaussianDenoiser().eval(), PixelDataset(), cfg, Accelerator(cpu=True))
    assert np.isfinite(fid) and fid > 0

    with pytest.raises(ConfigError, match="fid.ref is not set"):
        compute_fid(GaussianDenoiser(), PixelDataset(), {"num_samples": 4}, Accelerator(cpu=True))


def test_fid_cli_from_a_training_checkpoint(inception_weights, small_input, tmp_path):
    from conftest import FAST, compose_cfg
    from train.trainer import Trainer

    run = tmp_path / "run"
    Trainer(compose_cfg(*FAST, "data=digits", "trainer.ckpt_every=2", f"run_dir={run}")).fit()
    real = image_folder(tmp_path / "real", seed=3, brightness=255)
    common = ["--inception", str(inception_weights), "--batch-size", "2"]
    fid_main(["--images", str(real), "--save-stats", str(tmp_path / "ref.npz"), *common])

    fid = fid_main(["--checkpoint", str(run), "--ref", str(tmp_path / "ref.npz"), "--num-samples", "3", "--steps", "2", *common])
    assert np.isfinite(fid) and fid > 0
    (result_file,) = run.glob("checkpoints/*/fid.json")
    result = json.loads(result_file.read_text())
    assert result["fid"] == fid and result["num_images"] == 3 and result["step"] == 2


def test_trainer_logs_fid_periodically_and_refuses_a_missing_reference(inception_weights, small_input, tmp_path):
    from conftest import FAST, compose_cfg
    from train.trainer import Trainer

    real = image_folder(tmp_path / "real", seed=4, brightness=255)
    fid_main(["--images", str(real), "--save-stats", str(tmp_path / "ref.npz"), "--inception", str(inception_weights)])
    fid_keys = ["fid.every=2", f"fid.ref={tmp_path / 'ref.npz'}", f"fid.inception={inception_weights}",
                "fid.num_samples=3", "fid.steps=2", "fid.batch_size=3"]
    run = tmp_path / "run"
    Trainer(compose_cfg(*FAST, *fid_keys, f"run_dir={run}")).fit()
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    fids = [entry["fid"] for entry in logged if "fid" in entry]
    assert len(fids) == 1 and np.isfinite(fids[0])
    with pytest.raises(ConfigError, match="fid.ref is not set"):
        Trainer(compose_cfg(*FAST, "fid.every=2", f"run_dir={tmp_path / 'other'}"))


@pytest.mark.slow
def test_two_processes_give_the_same_fid_as_one(inception_weights, tmp_path):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    # Five images over two processes: uneven slices exercise the padded gather.
    folder = image_folder(tmp_path / "a", seed=4, brightness=255)
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(folder / "3.png")
    Image.fromarray(np.full((16, 16, 3), 200, dtype=np.uint8)).save(folder / "4.png")
    ref = image_folder(tmp_path / "ref", seed=5, brightness=128)
    args = ["--images", str(folder), "--ref", str(ref), "--inception", str(inception_weights), "--batch-size", "2"]
    one = fid_main([*args, "--out", str(tmp_path / "one.json")])
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29574",
              "-m", "train.fid", *args, "--out", str(tmp_path / "two.json")]
    result = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["num_images"] == 5 and two["processes"] == 2
    assert two["fid"] == pytest.approx(one, rel=1e-4)


def test_identical_folders_print_zero(inception_weights, small_input, tmp_path, capsys):
    same = image_folder(tmp_path / "same", seed=0, brightness=255)
    common = ["--inception", str(inception_weights), "--batch-size", "3"]
    assert fid_main(["--images", str(same), "--ref", str(same), *common]) == 0.0  # rounding below 0 is 0, not -0.0000
    assert capsys.readouterr().out.startswith("FID 0.0000 (3 images")


def test_a_corrupt_image_is_named(inception_weights, small_input, tmp_path, capsys):
    from train.cli import friendly_errors

    same = image_folder(tmp_path / "same", seed=0, brightness=255)
    common = ["--inception", str(inception_weights), "--batch-size", "3"]
    broken = image_folder(tmp_path / "broken", seed=1, brightness=255)
    (broken / "1.png").write_bytes(b"\x89PNG definitely not an image")
    with pytest.raises(SystemExit) as stop:  # as `python -m train.fid` runs it
        friendly_errors(fid_main)(["--images", str(broken), "--ref", str(same), "--out", str(tmp_path / "fid.json"), *common])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and not (tmp_path / "fid.json").exists()
    assert err.strip().splitlines()[-1] == (f"error: image '{broken / '1.png'}' is unreadable "
                                            "(UnidentifiedImageError); replace or delete it.")


def test_only_rounding_below_zero_is_zero():
    from train.metrics.frechet import frechet_distance

    mu, sigma = np.zeros(2), np.eye(2)
    assert frechet_distance(mu, sigma, mu, sigma) == 0.0 and str(frechet_distance(mu, sigma, mu, sigma)) == "0.0"
    # Not covariances (a negative variance): the negative distance is a fault to see, not rounding to hide.
    assert frechet_distance(mu, -sigma, mu, np.zeros((2, 2))) == -2.0
