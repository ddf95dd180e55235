"""The cross-backbone benchmark: FLOP-ideal speedups, the classifier scorer, and the whole grid end to end."""

import csv
import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from routing import Route, Router, build_policy
from train.bench.cost import speedups
from train.metrics.classifier import ClassifierConfig, SmallCNN, cache_path, features, load_or_train, sample_scores
from train.data.embedded import TensorDataset
from routing import count_flops
from conftest import CONFIGS, run_cli


class MLPBlock(nn.Module):
    """A block whose cost is exactly linear in the number of tokens: no attention, no scan."""

    needs_grid = False

    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x, c, grid):
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_flop_ideal_speedup_is_the_token_layer_count_of_an_mlp_stack():
    # Depth 8, route r2->5 with half the tokens bypassing, on an 8x8 grid of 64 tokens. Only the block stack
    # is counted (no embedding, no head), and the input needs grad, so every block does the same work per
    # token: forward + input grad + weight grad. Blocks 0, 1, 6, 7 see 64 tokens, blocks 2-5 see 32.
    torch.manual_seed(0)
    blocks = nn.ModuleList(MLPBlock(16) for _ in range(8))
    x = torch.randn(2, 64, 16, requires_grad=True)
    c = torch.zeros(2, 16)

    def step(router: Router):
        return lambda: router.run(blocks, x, c, (8, 8), training=True).square().sum().backward()

    routed = Router(build_policy("random"), [Route(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=5)])
    flops_unrouted, flops_routed = count_flops(step(Router()), grad=True), count_flops(step(routed), grad=True)
    assert flops_unrouted * (4 * 64 + 4 * 32) == flops_routed * (8 * 64)  # exact: gather/scatter cost no FLOPs
    ideal = speedups({"flops": flops_unrouted, "step_seconds": 2.0}, {"flops": flops_routed, "step_seconds": 1.0})
    assert ideal["ideal_speedup"] == pytest.approx(512 / 384)
    assert ideal["efficiency"] == pytest.approx(2.0 / (512 / 384))


def test_classifier_fd_of_a_set_with_itself_is_zero_and_accuracy_counts_requested_classes():
    torch.manual_seed(0)
    model = SmallCNN(in_channels=3, num_classes=5, width=8, feature_dim=16).eval()
    images = torch.rand(200, 3, 16, 16) * 2 - 1
    real = features(model, images)
    predicted = model(images).argmax(-1)
    same = sample_scores(model, images, predicted, real)
    assert abs(same["classifier_fd"]) < 1e-6 * real.var(0).sum().item()
    assert same["class_accuracy"] == 1.0
    # Control: shifted images are far away, and asking for other classes is never right.
    other = sample_scores(model, (images + 1).clamp(-1, 1), (predicted + 1) % 5, real)
    assert other["classifier_fd"] > 1e-3 * real.var(0).sum().item()
    assert sample_scores(model, images, (predicted + 1) % 5, real)["class_accuracy"] == 0.0


def test_classifier_is_cached_per_dataset_and_retrained_when_settings_change(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(40) % 2
    images = torch.where(labels[:, None, None, None].bool(), 0.8, -0.8) + 0.1 * torch.randn(40, 1, 8, 8, generator=g)
    dataset = TensorDataset(images, labels, 2, "toy")
    cfg = ClassifierConfig(width=4, feature_dim=8, epochs=2, batch_size=8)
    model, meta = load_or_train(dataset, cfg, tmp_path)
    assert cache_path(tmp_path, dataset).name == "classifier-toy-8px.safetensors" and cache_path(tmp_path, dataset).exists()
    assert 0.0 <= meta["heldout_accuracy"] <= 1.0

    import train.metrics.classifier as classifier

    trained = []
    original = classifier.train_classifier
    monkeypatch.setattr(classifier, "train_classifier", lambda *a: trained.append(1) or original(*a))
    again, _ = load_or_train(dataset, cfg, tmp_path)
    assert not trained
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    load_or_train(dataset, ClassifierConfig(width=4, feature_dim=8, epochs=1, batch_size=8), tmp_path)
    assert trained == [1]


def _filled(value) -> bool:
    return value is not None and str(value).strip() not in ("", "nan", "None") and not (isinstance(value, float) and math.isnan(value))


# The default suite runs two of bench=smoke's three families (rwkv stands for the grid-needing ones: its random cell is
# the 1-D ablation); the whole 3 x 3 grid, mamba too, runs under -m slow.
@pytest.mark.parametrize("backbones", [("dit", "rwkv"), pytest.param(("dit", "rwkv", "mamba"), marks=pytest.mark.slow)])
def test_smoke_grid_writes_a_full_table_and_a_rerun_reuses_every_cell(tmp_path, backbones):
    out = tmp_path / "bench"
    grid = ("bench=smoke", f"out_dir={out}", f"grid.backbones=[{','.join(backbones)}]")
    n = 3 * len(backbones)  # cells: each backbone with none, random and rows
    first = run_cli("train.bench", *grid)
    assert first.returncode == 0, first.stderr[-3000:]

    table = json.loads((out / "table.json").read_text())
    rows = table["rows"]
    assert [(r["backbone"], r["routing"]) for r in rows] == [(b, p) for b in backbones for p in ("none", "random", "rows")]
    kinds = {(r["backbone"], r["routing"]): r["kind"] for r in rows}
    assert all(kinds[(b, "random")] == "ablation" for b in backbones if b != "dit")
    assert kinds[("dit", "random")] == "routed" and kinds[("dit", "none")] == "baseline"
    for row in rows:
        # Peak memory exists on CUDA only; every other cell must hold a number.
        assert all(_filled(v) for k, v in row.items() if k != "peak_memory_mb"), row
        assert row["params"] > 0 and row["gflops_per_step"] > 0 and row["efficiency"] > 0
        assert row["train_steps"] == 2
        assert (row["ideal_speedup"] > 1) == (row["routing"] != "none")
    with (out / "table.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == n and all(_filled(v) for r in csv_rows for v in r.values())
    md_rows = [line for line in (out / "table.md").read_text().splitlines() if line.startswith(tuple(f"| {b}" for b in backbones))]
    assert len(md_rows) == n and all(_filled(cell) for line in md_rows for cell in line.strip("|").split("|"))
    assert (out / "loss_vs_time.png").stat().st_size > 0 and (out / "bars.png").stat().st_size > 0
    # Hydra's record and the job log are written by the bench into out_dir, once its checks passed.
    assert "bench=smoke" in (out / ".hydra" / "overrides.yaml").read_text()
    assert "table.md" in (out / "bench.log").read_text()

    cell_files = sorted((out / "cells").glob("*.json"))
    assert len(cell_files) == n
    mtimes = {p: p.stat().st_mtime_ns for p in [*cell_files, out / "cost.json"]}
    second = run_cli("train.bench", *grid)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stdout + second.stderr
    assert log.count("reused cell") == n and "reused cost measurements" in log
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    # A sub-grid reuses the bigger grid's costs and cells, and leaves its cost.json as it was.
    sub = run_cli("train.bench", "bench=smoke", f"out_dir={out}", "grid.backbones=[rwkv]", "grid.routings=[none,rows]")
    assert sub.returncode == 0, sub.stderr[-3000:]
    log = sub.stdout + sub.stderr
    assert log.count("reused cell") == 2 and f"(2 of its {n} cells)" in log
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes

    # The same classifier recipe, retrained on another CPU, comes out a little different: the cells it did not score are
    # refused in one sentence, not silently re-trained and overwritten. Every saved cell is checked, whatever the grid, so
    # the sub-grid's invocation shows it without composing the whole grid again.
    (weights,) = (out / "classifier").glob("classifier-*.safetensors")
    with safe_open(str(weights), "pt") as f:
        info = json.loads(f.metadata()["info"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(weights), metadata={"info": json.dumps(info | {"heldout_accuracy": info["heldout_accuracy"] + 0.0004})})
    third = run_cli("train.bench", "bench=smoke", f"out_dir={out}", "grid.backbones=[rwkv]", "grid.routings=[none,rows]")
    assert third.returncode == 2 and "Traceback" not in third.stderr, third.stderr[-3000:]
    assert str(weights) in third.stderr and "held-out accuracy" in third.stderr
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes


def test_moe_table_matches_activated_parameters_and_keeps_final_checkpoints(tmp_path):
    # DiffMoE and its baselines as rows of one table: dit is the dense baseline, tc and ec are variants of the diffmoe family.
    out = tmp_path / "bench"
    done = run_cli("train.bench", "bench=smoke", f"out_dir={out}", "grid.backbones=[dit,tc,ec,diffmoe]",
                      "grid.routings=[none,random]", "eval.keep_final=true")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["backbone"], r["routing"]): r for r in json.loads((out / "table.json").read_text())["rows"]}
    assert set(rows) == {(b, r) for b in ("dit", "tc", "ec", "diffmoe") for r in ("none", "random")}
    dense = rows[("dit", "none")]
    assert dense["activated_params"] == dense["params"] == dense["activated_params_inference"]
    for name in ("tc", "ec", "diffmoe"):
        row = rows[(name, "none")]
        assert row["params"] > dense["params"]  # 4 experts in every other block
        # One expert per token, as the dense MLP; only the gate (and DiffMoE's capacity predictor) comes on top.
        assert dense["activated_params"] < row["activated_params"] < 1.1 * dense["activated_params"]
        assert row["ideal_speedup"] == 1 and rows[(name, "random")]["ideal_speedup"] > 1
    # Top-1 token choice and expert choice at C = 1 give every token one expert at sampling too; DiffMoE's is dynamic.
    assert rows[("tc", "none")]["experts_per_token_inference"] == 1.0
    assert rows[("ec", "none")]["experts_per_token_inference"] == 1.0
    assert rows[("diffmoe", "none")]["experts_per_token_inference"] >= 0
    text = (out / "table.md").read_text()
    assert "activated params / token (8)" in text and "experts / token, sampling (8)" in text
    # eval.keep_final: the final checkpoint of every cell stays, loadable for more sampling; nothing else is kept.
    from train.checkpoint import load_run

    for cell in ("tc-random-s0", "diffmoe-none-s0"):
        kept = sorted((out / "runs" / cell / "checkpoints").glob("step_*"))
        assert [p.name for p in kept] == ["step_0000002"]
        assert load_run(out / "runs" / cell).step == 2


def test_report_compares_routed_rows_with_unrouted_and_moe_rows_with_their_baseline():
    from omegaconf import OmegaConf

    from train.bench.cells import Cell
    from train.bench.report import markdown, table_rows

    def cell(backbone, routing):
        routes = [{"selection_ratio": 0.5}] if routing != "none" else []
        return Cell(backbone, routing, 0, OmegaConf.create({"routing": {"routes": routes}}), False)

    pairs = [cell(b, r) for b in ("dit", "diffmoe") for r in ("none", "random")]
    cost = {"params": 10, "tokens": 4, "flops": 1e9, "step_seconds": 1.0, "saved_activation_bytes": 0, "peak_memory_bytes": None}
    costs = {p.key: cost for p in pairs}
    losses = {"dit-none": [0.50, 0.52, 0.51], "dit-random": [0.40, 0.41, 0.42],
              "diffmoe-none": [0.60, 0.61, 0.62], "diffmoe-random": [0.40, 0.42, 0.41]}
    runs = {key: [{"ema_loss": v, "train_steps": 1, "train_seconds": 1.0, "stalled_seconds": 0.0} for v in vals]
            for key, vals in losses.items()}
    rows = {(r["backbone"], r["routing"]): r for r in table_rows(pairs, costs, runs, {"diffmoe": "dit"})}
    assert rows[("dit", "random")]["ema_loss_verdict"] == "wins" and "ema_loss_vs_base_diff" not in rows[("dit", "random")]
    # DiffMoE unrouted is worse than dit unrouted (+0.1), and ties it when both are routed (+0.0).
    assert rows[("diffmoe", "none")]["ema_loss_vs_base_diff"] == pytest.approx(0.1)
    assert rows[("diffmoe", "none")]["ema_loss_vs_base_verdict"] == "loses"
    assert rows[("diffmoe", "random")]["ema_loss_vs_base_verdict"] == "ties"
    meta = {"command": "x", "date": "d", "machine": {"cpu": "c", "cores": 2, "torch": "t", "device": "cpu", "threads": 1},
            "load_average": "0", "timing": {"batch": 1, "tokens": 4, "repeats": 1, "warmup": 0},
            "train": {"budget": "b", "data": "d", "tokens": 4, "batch_size": 1, "seeds": [0, 1, 2]},
            "eval": {"loss_batch": 1, "reference": "r", "samples": 1, "steps": 1, "guidance": 1, "seed": 0, "num_real": 1,
                     "real_scores": {"classifier_fd": 1.0, "class_accuracy": 1.0}},
            "classifier": {"heldout_accuracy": 1.0, "config": {"feature_dim": 8}}}
    text = markdown(list(rows.values()), meta)
    assert "| diffmoe | dit | none | +0.1000" in text and "| dit | random | -0.1000" in text

    # A cell that lost a fifth of its time to another job: a step budget loses time (img/s is marked), a wall-clock
    # budget loses steps (steps are marked).
    for quality in runs.values():
        for q in quality:
            q["images_per_s"] = 16.0
    runs["dit-random"][0]["stalled_seconds"] = 0.2
    rows = table_rows(pairs, costs, runs, {"diffmoe": "dit"})
    for wall_clock, marked in ((False, "16 ± 0"), (True, "1 ± 0")):
        text = markdown(rows, {**meta, "train": {**meta["train"], "wall_clock": wall_clock}})
        line = next(x for x in text.splitlines() if x.startswith("| dit | random"))
        assert line.count("†") == 1 and f"| {marked} † |" in line, line
        assert ("trained fewer steps" in text) == wall_clock


def test_a_cell_killed_after_its_last_checkpoint_resumes_and_measured_only_trains_nothing(tmp_path):
    out = tmp_path / "bench"
    args = ("bench=smoke", f"out_dir={out}", "grid.backbones=[dit]", "grid.routings=[none]", "eval.every=1", "eval.keep_final=true")
    first = run_cli("train.bench", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    cell = out / "cells" / "dit-none-s0.json"
    before = json.loads(cell.read_text())
    assert before["resumed_at_step"] is None

    # Killed while scoring: the final checkpoint is on disk, the cell's result is not.
    cell.unlink()
    second = run_cli("train.bench", *args)
    assert second.returncode == 0, second.stderr[-3000:]
    after = json.loads(cell.read_text())
    assert "resumed from" in second.stdout + second.stderr
    assert after["resumed_at_step"] == after["train_steps"] == 2
    # The same weights, scored again: the same numbers; the clock continues the killed attempt's.
    for key in ("ema_loss", "classifier_fd", "class_accuracy", "train_seconds"):
        assert after[key] == pytest.approx(before[key], rel=1e-6), key

    # The table from what is measured: seed 1 is missing, named, and not trained.
    partial = run_cli("train.bench", *args, "seeds=[0,1]", "measured_only=true")
    assert partial.returncode == 0, partial.stderr[-3000:]
    assert "dit-none-s1" in partial.stdout + partial.stderr and not (out / "runs" / "dit-none-s1").exists()
    assert [r["seeds"] for r in json.loads((out / "table.json").read_text())["rows"]] == [1]
    assert "not measured yet: dit-none-s1" in (out / "table.md").read_text()


@pytest.mark.parametrize("key", ["measured_only=maybe", "shard=2/2"])
def test_a_bad_invocation_key_is_one_sentence_before_any_work(tmp_path, key):
    bad = run_cli("train.bench", "bench=smoke", f"out_dir={tmp_path / 'bench'}", key)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert key.split("=")[0] in bad.stderr
    assert not (tmp_path / "bench" / "cost.json").exists()  # refused before the cost phase


def test_measured_only_with_no_cell_is_refused_before_the_cost_phase_and_the_classifier(tmp_path):
    bad = run_cli("train.bench", "bench=smoke", f"out_dir={tmp_path / 'bench'}", "measured_only=true")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert f"measured_only=true but {tmp_path / 'bench' / 'cells'} holds no cell of this grid" in bad.stderr
    assert not (tmp_path / "bench").exists()  # nothing timed, trained or written


def test_a_routed_cell_without_its_unrouted_cell_is_refused_under_a_step_budget(tmp_path):
    # Its budget is the unrouted step count x its measured speedup; without dit-none it used to train the unrouted count.
    bad = run_cli("train.bench", "bench=smoke", f"out_dir={tmp_path / 'bench'}", "grid.backbones=[dit]", "grid.routings=[random]",
                  "train.steps={dit: 2}")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "dit-none is not in the grid" in bad.stderr and "grid.routings" in bad.stderr
    assert not (tmp_path / "bench" / "cost.json").exists()
    # The same holds for another bench's costs (train.speedups_from): they must include the unrouted cell.
    theirs = tmp_path / "cost.json"
    theirs.write_text(json.dumps({"cells": {"dit-random": {"flops": 1.0, "step_seconds": 1.0}}}))
    bad = run_cli("train.bench", "bench=smoke", f"out_dir={tmp_path / 'bench'}", "grid.backbones=[dit]", "grid.routings=[random]",
                  "train.steps={dit: 2}", f"train.speedups_from={theirs}")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "train.speedups_from" in bad.stderr and "dit-none" in bad.stderr
    assert not (tmp_path / "bench" / "cost.json").exists()


def test_a_claimed_cell_is_skipped_while_its_process_lives_and_taken_over_after(tmp_path):
    import subprocess

    from train.bench.claims import claim

    path = tmp_path / "claims" / "dit-none-s0.pid"
    other = subprocess.Popen(["sleep", "30"])
    try:
        path.parent.mkdir(parents=True)
        path.write_text(str(other.pid))
        with claim(path) as holder:
            assert holder == other.pid, "a live process's claim is respected"
    finally:
        other.kill()
        other.wait()
    with claim(path) as holder:
        assert holder is None and path.read_text() == str(os.getpid()), "a dead process's claim is taken over"
    assert not path.exists(), "released after the block"


def test_grid_last_pairs_come_after_every_seed_of_the_others():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from train.bench.cells import grid_cells

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        bench = compose(config_name="bench", overrides=["bench=smoke", "seeds=[0,1]", "grid.backbones=[dit]",
                                                        "grid.routings=[none,random,rows]", "grid.last=[dit-rows]"])
        names = [c.name for c in grid_cells(bench)]
    assert names == ["dit-none-s0", "dit-random-s0", "dit-none-s1", "dit-random-s1", "dit-rows-s0", "dit-rows-s1"]
    assert OmegaConf.select(bench, "grid.last") == ["dit-rows"]


def test_compose_config_caches_per_search_path_and_hands_out_copies(tmp_path):
    from hydra import initialize_config_dir

    from train.bench.cells import compose_config

    for value in (1, 2):
        (tmp_path / f"c{value}").mkdir()
        (tmp_path / f"c{value}" / "config.yaml").write_text(f"x: {value}\n")
    with initialize_config_dir(config_dir=str(tmp_path / "c1"), version_base="1.3"):
        first = compose_config([])
        first.x = 99  # the caller's copy: the next caller still gets the composed value
        assert compose_config([]).x == 1 and compose_config(["x=3"]).x == 3
    with initialize_config_dir(config_dir=str(tmp_path / "c2"), version_base="1.3"):
        assert compose_config([]).x == 2, "another config folder is another cache entry"


def test_recipe_table_names_the_winner_per_family_and_compares_recipes_with_welch_intervals():
    from train.bench import recipes

    def row(backbone, routing, fd, kind="routed"):
        return {"backbone": backbone, "routing": routing, "kind": kind, "classifier_fd_seeds": fd, "class_accuracy_seeds": [0.5] * len(fd)}

    rows = [row("rwkv", "none", [80.0, 82.0, 81.0], "baseline"), row("rwkv", "random", [10.0, 11.0, 12.0], "ablation"),
            row("rwkv", "rows", [70.0, 71.0, 72.0]), row("rwkv", "structured", [60.0, 61.0, 62.0]),
            row("rwkv", "sprint", [50.0, 65.0, 80.0], "sprint")]
    lines = recipes.markdown(rows)
    best = next(l for l in lines if l.startswith("| rwkv | classifier-FD, equal compute"))
    # The 1-D ablation (random on a scan-order model, FD 11) is no recipe: structured has the best mean, and SPRINT's
    # seeds spread too far to separate it from the runner-up.
    assert best.endswith("| structured | -4.0 [-41.0, +33.0] ties (vs sprint) |"), best
    assert "| rwkv | structured - rows | -10.0 [-12.3, -7.7] wins |" in "\n".join(lines)
    assert "| rwkv | sprint - structured | +4.0 [-33.0, +41.0] ties |" in "\n".join(lines)
    assert not any(l.startswith("| rwkv-") for l in lines)  # rows that do not name their seeds get no per-seed line

    # Every seed beside the mean it makes: one step count when the seeds share the budget, each value otherwise.
    rows[3] |= {"cell_seeds": [0, 2], "train_steps_seeds": [2047, 2047], "classifier_fd_seeds": [60.0, 62.25],
                "class_accuracy_seeds": [0.25, 0.25], "ema_loss_seeds": [0.2081, None]}
    rows[2] |= {"ema_loss_seeds": [0.2100, 0.2110]}
    seeded = recipes.markdown(rows)
    assert "| rwkv | held-out EMA loss, equal compute |  |  | 0.2105 (2) | 0.2081 (1) |  | structured | -0.0024 n/a (one seed) (vs rows) |" in "\n".join(seeded)
    assert "| rwkv-structured-s0 / s2 | 2047 | 0.2081 / n/a | 60.0 / 62.2 | 25.0% / 25.0% |  |  |  |" in seeded, seeded[-3:]


def test_an_aligned_cell_is_named_costs_its_alignment_and_the_fashion_grid_keeps_its_committed_cells(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from train.bench.cells import grid_cells, grid_pairs, set_step_budget
    from train.bench.cost import cost_phase
    from train.bench.store import same_settings

    width = 64  # projector width
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        bench = compose(config_name="bench", overrides=[
            "bench=smoke", f"out_dir={tmp_path}", "grid.backbones=[dit]", "grid.routings=[none,random]", "grid.aligns=[none,self]",
            "grid.aligned=[dit-none,dit-random]", f"+grid.align_overrides.self=['align.projector_width={width}']",
            "timing.warmup=0", "timing.repeats=1"])
        cells = grid_cells(bench)
        fashion = compose(config_name="bench", overrides=["bench=fashion"])
        # Hydra composes each pair (about 0.15 s of CPU twice), so only the pairs checked below are composed: the
        # committed ones (align none and self) and dit-random's with every alignment (the sra cells and the sweep).
        fashion_cells = grid_cells(compose(config_name="bench", overrides=["bench=fashion", "grid.aligns=[none,self]"]))
        dit_random = grid_cells(compose(config_name="bench", overrides=["bench=fashion", "grid.backbones=[dit]",
                                                                        "grid.routings=[random]", "grid.aligned=null"]))
        results = CONFIGS.parent / "docs/bench/fashion"
        saved_cost = json.loads((results / "cost.json").read_text())
        # measure_aligned=False: a cost file whose settings no longer matched would be left out (and fail below), not re-measured.
        costs = cost_phase(fashion, [c for c in fashion_cells if c.seed == 0], results, tuple(saved_cost["settings"]["shape"]), 10,
                           measure_aligned=False)["cells"]
        cost = cost_phase(bench, cells, tmp_path, (1, 8, 8), 10)["cells"]  # composes each family's unaligned base: in Hydra
        # measured_only: an alignment whose cost file does not exist yet is left out, not measured.
        unpriced = cost_phase(bench, cells, tmp_path / "fresh", (1, 8, 8), 10, measure_aligned=False)["cells"]
    assert set(unpriced) == {"dit-none", "dit-random"} and not (tmp_path / "fresh" / "cost-self.json").exists()
    assert [c.key for c in cells] == ["dit-none", "dit-random", "dit-none-self", "dit-random-self"]
    assert [c.cfg.align.name for c in cells] == ["none", "none", "self", "self"]
    assert cells[3].name == "dit-random-self-s0" and cells[3].cfg.run_dir.endswith("runs/dit-random-self-s0")
    assert cells[3].cfg.align.projector_width == width and cells[3].recipe == "random + self"

    # The aligned cells are timed in their own unit, beside their family's unrouted unaligned cell; their FLOPs hold
    # the projector's forward and backward on every token (dit-none: no route) AND the EMA teacher's forward.
    assert set(json.loads((tmp_path / "cost-self.json").read_text())["cells"]) == {"dit-none", "dit-none-self", "dit-random-self"}
    assert set(json.loads((tmp_path / "cost.json").read_text())["cells"]) == {"dit-none", "dit-random"}
    aligned, plain = cost["dit-none-self"], cost["dit-none"]
    tokens, hidden = bench.timing.batch * plain["tokens"], bench.sizes.dit.hidden_size
    projector = 3 * 2 * tokens * (hidden * width + width * hidden)  # SRA's 2-layer head: forward + input and weight grads
    assert aligned["flops"] > plain["flops"] + projector
    assert aligned["params"] == plain["params"] and aligned["align_params"] == hidden * width + width + width * hidden + hidden
    assert aligned["base"]["flops"] == plain["flops"]  # the unit's own unaligned base, the same step
    assert speedups(None, aligned)["ideal_speedup"] < 1 < speedups(None, cost["dit-random-self"])["ideal_speedup"] + 1
    set_step_budget(cells[2], 100, speedups(None, aligned)["measured_speedup"])
    assert 0 < cells[2].cfg.trainer.max_steps == round(100 * aligned["base"]["step_seconds"] / aligned["step_seconds"])

    # configs/bench/fashion.yaml: the 21 pairs of the committed table, the 12 self cells measured first (weight 2, REPA's
    # projector: committed), the same 12 at SRA's settings (sra) and the weight sweep on dit-random (2 seeds each); every
    # committed cell file still matches its cell's settings (so the bench reuses it, never retrains or overwrites it).
    committed = {p.name.rsplit("-s", 1)[0] for p in (CONFIGS.parent / "docs/bench/fashion/cells").glob("*.json")}
    keys = ["-".join(p if p[2] != "none" else p[:2]) for p in grid_pairs(fashion)]
    twelve = [f"{b}-{r}" for b, rs in (("dit", "none random sprint"), ("rwkv", "none rows sprint"),
                                       ("mamba", "none rows sprint"), ("diffmoe", "none random sprint")) for r in rs.split()]
    sweep = ["dit-random-sra_w0.2", "dit-random-sra_w0.5", "dit-random-sra_w2"]
    aligned_keys = {f"{k}-{a}" for a in ("self", "sra") for k in twelve} | set(sweep)
    unaligned = committed - aligned_keys
    # The sra cells and the sweep land as they are measured; the weight-2 self cells are all committed.
    assert len(unaligned) == 21 and {f"{k}-self" for k in twelve} <= committed <= unaligned | aligned_keys
    assert sorted(keys) == sorted([*unaligned, *(f"{k}-{a}" for a in ("self", "sra") for k in twelve), *sweep])
    assert [c.name for c in dit_random if c.key in sweep] == [f"{k}-s{s}" for s in (0, 1) for k in sweep]
    sra = next(c for c in dit_random if c.key == "dit-random-sra")
    assert (sra.cfg.align.name, sra.cfg.align.weight, sra.cfg.align.head, sra.recipe) == ("self", 0.04, "sra", "random + self, SRA's (weight 0.04)")
    assert next(c for c in dit_random if c.key == "dit-random-self").recipe == "random + self, weight 2 (not SRA's)"
    assert len(fashion_cells) == 99 and {c.key for c in fashion_cells} <= set(costs)
    for cell in fashion_cells:
        set_step_budget(cell, fashion.train.steps[cell.backbone], speedups(costs[f"{cell.backbone}-none"], costs[cell.key])["measured_speedup"])
        saved = json.loads((results / "cells" / f"{cell.name}.json").read_text())["settings"]["train"]
        current, plain = json.loads(json.dumps([OmegaConf.to_container(cell.cfg, resolve=True), cell.plain]))
        assert same_settings(saved, current, plain), cell.name


def test_alignment_table_says_per_family_whether_alignment_adds_to_each_recipe():
    from train.bench import recipes

    def row(routing, fd, align="none"):
        return {"backbone": "dit", "routing": routing, "align": align, "kind": "routed" if routing != "none" else "baseline",
                "classifier_fd_seeds": fd}

    rows = [row("none", [40.0, 41.0, 42.0]), row("random", [38.0, 39.0, 40.0]),
            row("none", [30.0, 31.0, 32.0], "self"), row("random", [37.0, 40.0, 43.0], "self")]
    lines = recipes.markdown(rows)
    text = "\n".join(lines)
    assert "| dit | none + self - none | -10.0 [-12.3, -7.7] wins |" in text
    assert "| dit | random + self - random | +1.0 [" in text and "] ties |" in text.split("random + self - random")[1].splitlines()[0]
    assert not recipes.markdown(rows[:2])  # without aligned rows (and without structured or SPRINT) no recipe tables
    # A variant of an alignment is named by its label (grid.align_labels), e.g. the first self cells at weight 2.
    rows[2] |= {"align_label": "self, weight 2 (not SRA's)"}
    assert "| dit | none + self, weight 2 (not SRA's) - none | -10.0 [-12.3, -7.7] wins |" in "\n".join(recipes.markdown(rows))


def test_an_alignment_variant_on_some_seeds_keeps_its_pair_and_its_label():
    """A variant trained on seeds that lack the grid's first (grid.align_seeds) still has its pair (its cost is measured
    with its first cell), and the tables name it by its label (grid.align_labels)."""
    from train.bench.cells import Cell, pair_cells

    cells = [Cell("dit", "random", s, None, False, align=a, align_label=label)
             for s in (0, 1) for a, label in (("none", None), ("self_w2", "self, weight 2 (not SRA's)")) if a == "none" or s == 1]
    assert [(c.key, c.seed) for c in pair_cells(cells)] == [("dit-random", 0), ("dit-random-self_w2", 1)]
    assert cells[-1].recipe == "random + self, weight 2 (not SRA's)" and cells[0].recipe == "random"
