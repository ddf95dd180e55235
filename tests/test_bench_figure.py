"""`python -m train.bench.figure` and `.figure_align`: the front page's and the alignment figures, drawn from the committed
Fashion-MNIST cells alone."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from PIL import Image

from train.bench.figure import best_cells, fd_summaries, main, read_cells
from train.bench.figure_align import FIRST_STEP, mean_curve, read_pairs
from train.bench.figure_align import main as align_main

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "bench" / "fashion"


def refused(command, argv: list[str], message: str, capsys) -> None:
    """`command argv` ends with exit code 2 and one `error:` line matching `message`, as every refusal does."""
    with pytest.raises(SystemExit) as stop:
        command(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and re.search(message, err) and err.count("error:") == 1 and "Traceback" not in err, err


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


def test_a_folder_without_cells_or_samples_is_refused_in_one_sentence(tmp_path, capsys):
    refused(main, ["--results", str(tmp_path), "--out", str(tmp_path / "front.png")], "no cell files", capsys)
    shutil.copytree(RESULTS / "cells", tmp_path / "cells")
    refused(main, ["--results", str(tmp_path), "--out", str(tmp_path / "front.png")], "no sample grid .*dit-sprint-s0.png",
            capsys)
    assert not (tmp_path / "front.png").exists()


def test_the_alignment_pairs_hold_only_their_own_cells():
    pairs = read_pairs(RESULTS / "cells", "sra")
    assert len(pairs) == 12  # four families x none, their TREAD, SPRINT
    for (family, _), sides in pairs.items():
        assert {c["cell"].rsplit("-s", 1)[0] for c in sides["none"]} == {f"{family}-{sides['none'][0]['routing']}"}
        assert {c["cell"].rsplit("-s", 1)[0] for c in sides["sra"]} == {f"{family}-{sides['none'][0]['routing']}-sra"}
    steps, mean, low, high = mean_curve(pairs[("dit", "tread")]["sra"])
    assert steps[0] >= FIRST_STEP and all(lo <= m <= hi for m, lo, hi in zip(mean, low, high))


def test_the_alignment_figure_is_written_or_refused(tmp_path, capsys):
    align_main(["--results", str(RESULTS), "--out", str(tmp_path / "align.png")])
    assert Image.open(tmp_path / "align.png").size[0] > 1000
    refused(align_main, ["--results", str(RESULTS), "--align", "nonesuch", "--out", str(tmp_path / "other.png")],
            "no family x recipe .* --align at an alignment it measured", capsys)
    assert not (tmp_path / "other.png").exists()


def test_the_alignment_table_compares_each_pair_at_equal_compute_and_at_a_matched_step(capsys):
    align_main(["--results", str(RESULTS), "--table", "--also", "self"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + 12
    row = next(line for line in lines if line.startswith("| dit-random |")).split(" | ")
    pairs = read_pairs(RESULTS / "cells", "sra")[("dit", "tread")]
    fd = sum(c["classifier_fd"] for c in pairs["sra"]) / 3 - sum(c["classifier_fd"] for c in pairs["none"]) / 3
    assert row[4].startswith(f"{fd:+.1f} [") and row[6].endswith(f"(step {pairs['sra'][0]['train_steps'] // 100 * 100:,})")
    assert row[7].rstrip(" |").endswith(("wins", "loses", "ties"))  # weight 2's cells, dit-random-self-s*
    refused(align_main, ["--results", str(RESULTS), "--table", "--align", "nonesuch"], "no family x recipe", capsys)


@pytest.mark.parametrize("damage,message", [("{not json", "not a readable cell file"), ("[1, 2]", "not a bench cell file")])
def test_a_damaged_cell_file_is_named_in_one_sentence_and_nothing_is_drawn(tmp_path, damage, message, capsys):
    shutil.copytree(RESULTS / "cells", tmp_path / "cells")
    (tmp_path / "cells" / "dit-random-sra-s1.json").write_text(damage)
    for draw in (main, align_main):
        refused(draw, ["--results", str(tmp_path), "--out", str(tmp_path / "out.png")], f"dit-random-sra-s1.json is {message}",
                capsys)
    assert not (tmp_path / "out.png").exists()
