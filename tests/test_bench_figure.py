"""`python -m train.bench.figure`: the front page's figure, drawn from the committed Fashion-MNIST cells alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image

from train.bench.figure import best_cells, fd_summaries, main, read_cells

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "bench" / "fashion"


def test_the_best_cells_are_the_lowest_mean_classifier_fd_of_each_family():
    cells = read_cells(RESULTS / "cells")
    fds = fd_summaries(cells)
    best = best_cells(cells, fds)
    for family, cell in best.items():
        routed = {recipe: s["mean"] for (f, recipe), s in fds.items() if f == family and recipe != "none"}
        assert routed[cell["recipe"]] == min(routed.values())
        assert cell["seed"] == 0 and (RESULTS / "samples" / f"{cell['cell']}.png").is_file()
    assert all(len(cells[key]) == 3 for key in cells if key[0] in best)  # every drawn recipe has its three seeds


def test_the_figure_is_written(tmp_path):
    main(["--results", str(RESULTS), "--out", str(tmp_path / "front.png")])
    assert Image.open(tmp_path / "front.png").size[0] > 1000


def test_a_folder_without_cells_or_samples_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(SystemExit, match="no cell files"):
        main(["--results", str(tmp_path), "--out", str(tmp_path / "front.png")])
    shutil.copytree(RESULTS / "cells", tmp_path / "cells")
    with pytest.raises(SystemExit, match="no sample grid .*dit-sprint-s0.png"):
        main(["--results", str(tmp_path), "--out", str(tmp_path / "front.png")])
    assert not (tmp_path / "front.png").exists()
