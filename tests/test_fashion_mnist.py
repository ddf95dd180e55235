"""Fashion-MNIST: the idx loader on tiny fake files, the missing-files message, and the held-out metric.

No test needs the real dataset (CI installs nothing from apt): each writes its own idx files.
"""

import gzip
import struct

import numpy as np
import pytest
import torch

from conftest import compose_cfg, run_cli
from routing.errors import ConfigError
from train.bench.quality import held_out_split
from train.bench.stats import summary, verdict, welch_difference
from train.data import build_dataset
from train.data.fashion_mnist import fashion_mnist, read_idx
from train.metrics.classifier import ClassifierConfig, SmallCNN, features, load_or_train
from train.metrics.heldout import HeldOutReference


def write_idx(path, array: np.ndarray, compress: bool = True) -> None:
    """The idx format: magic 0, 0, type 0x08 (ubyte), ndim, then big-endian uint32 sizes, then the bytes."""
    raw = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


def fake_fashion(root, n_train: int = 6, n_test: int = 4, compress: bool = True):
    """Train images hold the value 255 - i (one per image), test images 10 + i; labels i % 10 and (9 - i) % 10."""
    root.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if compress else ""
    train = np.stack([np.full((28, 28), 255 - i) for i in range(n_train)])
    test = np.stack([np.full((28, 28), 10 + i) for i in range(n_test)])
    write_idx(root / f"train-images-idx3-ubyte{ext}", train, compress)
    write_idx(root / f"train-labels-idx1-ubyte{ext}", np.arange(n_train) % 10, compress)
    write_idx(root / f"t10k-images-idx3-ubyte{ext}", test, compress)
    write_idx(root / f"t10k-labels-idx1-ubyte{ext}", (9 - np.arange(n_test)) % 10, compress)
    return root


@pytest.mark.parametrize("compress", [True, False])
def test_loader_reads_idx_pads_to_32_maps_to_unit_range_and_selects_the_split(tmp_path, compress):
    root = fake_fashion(tmp_path / "fm", compress=compress)
    train = fashion_mnist(str(root), "train")
    test = fashion_mnist(str(root), "test")
    assert len(train) == 6 and len(test) == 4 and train.shape == test.shape == (1, 32, 32) and train.num_classes == 10
    x, labels = train.get(torch.arange(6))
    assert x.shape == (6, 1, 32, 32) and x.min() >= -1 and x.max() <= 1
    assert torch.equal(labels, torch.arange(6))
    assert torch.equal(test.get(torch.arange(4))[1], torch.tensor([9, 8, 7, 6]))
    # 28 -> 32: two rows / columns of -1 (black background) on every side, the image centred.
    assert (x[:, :, :2] == -1).all() and (x[:, :, -2:] == -1).all() and (x[:, :, :, :2] == -1).all() and (x[:, :, :, -2:] == -1).all()
    assert torch.allclose(x[:, 0, 2:30, 2:30], (255 - torch.arange(6.0)).view(6, 1, 1) / 127.5 - 1)  # 255 -> +1
    assert torch.allclose(test.get(torch.tensor([0]))[0][0, 0, 2:30, 2:30], torch.tensor(10 / 127.5 - 1))
    # The registry and the config group reach the same loader.
    cfg = compose_cfg("data=fashion_mnist", f"data.path={root}", "data.split=test")
    assert len(build_dataset(cfg.data, cfg.edm.sigma_data)) == 4


def test_read_idx_refuses_a_truncated_file(tmp_path):
    path = tmp_path / "x-idx3-ubyte"
    write_idx(path, np.zeros((3, 28, 28)), compress=False)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ConfigError, match="truncated"):
        read_idx(path)


def test_a_label_past_the_ten_classes_is_refused(tmp_path):
    root = fake_fashion(tmp_path / "fm")
    write_idx(root / "train-labels-idx1-ubyte.gz", np.array([0, 1, 2, 3, 4, 12]))
    with pytest.raises(ConfigError, match=r"train-labels-idx1-ubyte\.gz' holds label 12.*10 classes"):
        fashion_mnist(str(root), "train")


def test_missing_files_name_the_apt_package_and_the_path_key(tmp_path):
    with pytest.raises(ConfigError, match=r"apt-get install dataset-fashion-mnist.*data\.path"):
        fashion_mnist(str(tmp_path / "nowhere"), "train")
    # As a user sees it: one sentence and exit status 2, no traceback.
    result = run_cli("train", "data=fashion_mnist", f"data.path={tmp_path / 'nowhere'}", "trainer.cpu=true",
                        f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "apt-get install dataset-fashion-mnist" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_heldout_reference_is_the_test_split_and_the_floor_uses_train_images(tmp_path):
    root = fake_fashion(tmp_path / "fm", n_train=30, n_test=20)
    cfg = compose_cfg("data=fashion_mnist", f"data.path={root}")
    train = build_dataset(cfg.data, cfg.edm.sigma_data)
    test = held_out_split(cfg, cfg.edm.sigma_data)
    assert test.name == "fashion_mnist-test" and len(test) == 20 and cfg.data.split == "train"
    torch.manual_seed(0)
    model = SmallCNN(1, 10, width=4, feature_dim=8).eval()
    ref = HeldOutReference(model, test, train, num_real=20, num_samples=10, seed=0)
    test_features = features(model, test.get(torch.arange(20))[0])
    train_features = features(model, train.get(torch.arange(30))[0])
    # The FD reference holds exactly the test images' features (in some order), none of train's.
    assert torch.allclose(ref.real_features.sort(0).values, test_features.sort(0).values)
    assert not torch.allclose(ref.real_features.mean(0), train_features.mean(0))
    # Test images scored against themselves are at distance ~0; the floor (train images) is not.
    assert abs(ref.score(*test.get(torch.arange(20)))["classifier_fd"]) < 1e-6 + 1e-6 * test_features.var(0).sum().item()
    assert ref.floor["classifier_fd"] > 1e-3


def test_classifier_accuracy_is_measured_on_the_test_split(tmp_path):
    root = fake_fashion(tmp_path / "fm", n_train=20, n_test=10)
    train, test = fashion_mnist(str(root), "train"), fashion_mnist(str(root), "test")
    _, meta = load_or_train(train, ClassifierConfig(width=4, feature_dim=8, epochs=1, batch_size=8), tmp_path / "cache", test)
    assert meta["accuracy_on"] == "fashion_mnist-test (10 images)" and 0 <= meta["heldout_accuracy"] <= 1


def test_seed_statistics_use_student_t_and_welch_intervals():
    s = summary([1.0, 2.0, 3.0])
    assert s["mean"] == 2.0 and s["std"] == 1.0 and s["ci95"] == pytest.approx(4.302653 / 3**0.5, rel=1e-5)
    assert summary([5.0])["ci95"] is None
    apart = welch_difference([1.0, 1.1, 0.9], [2.0, 2.1, 1.9])
    assert apart["diff"] == pytest.approx(-1.0) and apart["high"] < 0
    assert verdict(apart, lower_is_better=True) == "wins" and verdict(apart, lower_is_better=False) == "loses"
    assert verdict(welch_difference([1.0, 3.0], [2.0, 2.5]), lower_is_better=True) == "ties"


def test_one_training_step_on_fake_fashion_mnist(tmp_path, cfg_factory):
    from train.trainer import Trainer

    root = fake_fashion(tmp_path / "fm", n_train=8, n_test=4)
    cfg = cfg_factory("data=fashion_mnist", f"data.path={root}", "backbone.patch_size=4", "trainer.max_steps=1")
    losses = Trainer(cfg).fit()
    assert len(losses) == 1 and losses[0] > 0
