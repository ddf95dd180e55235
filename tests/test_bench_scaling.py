"""`python -m train.bench.scaling`: the FLOP curve's shape (attention's quadratic term in DiT, the scans' flat cost per
token), the dry run at the smallest shape, a cell that runs out of memory reported "does not fit", and bad arguments
refused in one sentence. Nothing here times anything."""

from __future__ import annotations

import json

import pytest
import torch

from train.bench import scaling

FIGURES = scaling.ROOT / "docs" / "figures"


def test_flop_curve_dit_grows_per_token_and_rwkv_stays_flat():
    # Equal tokens per step (4 x 256 = 1 x 1024): a flat line is a cost linear in tokens.
    unrouted = {(g.family, g.tokens): scaling.group_flops(g, ("none",))["none"]
                for g in scaling.grid(["dit", "rwkv"], ["tiny"], [256, 1024], 1024)}
    growth = {f: unrouted[f, 1024] / unrouted[f, 256] for f in ("dit", "rwkv")}
    # DiT-tiny (D = 128, 8 blocks): attention's 4 N D FLOPs per token and layer against about 24 D^2 in the linear
    # layers grow the step by about 1.8x from 256 to 1,024 tokens; RWKV's matmuls stay per token.
    assert growth["dit"] > 1.5, growth
    assert 0.98 < growth["rwkv"] < 1.02, growth


@pytest.mark.slow
def test_flop_count_on_fake_tensors_equals_the_real_step():
    """The curve's count (fake tensors, forward and backward) is that of a whole real step on the CPU (AdamW
    included), the scans opaque in both through the same ops; and routing saves FLOPs, SPRINT the most."""
    group = scaling.Group("mamba", "tiny", 16, 2)
    with scaling.opaque_scans():
        steps = scaling.recipe_steps(group, torch.device("cpu"), draws=False)
        real = {recipe: scaling.count_flops(steps[recipe], grad=True) for recipe in scaling.RECIPES}
    assert scaling.group_flops(group) == real
    assert real["none"] > real["tread"] > real["sprint"] > 0, real


def test_dry_run_builds_and_steps_each_recipe_at_the_smallest_shape(tmp_path, capsys):
    result = scaling.main(["--dry-run", "--families", "dit", "--out", str(tmp_path)])
    rows = result["dry_run"]
    assert [(r["family"], r["preset"], r["tokens"], r["batch"], r["recipe"]) for r in rows] == [
        ("dit", "tiny", 256, 1, recipe) for recipe in scaling.RECIPES]
    assert all(r["fits"] and r["ms"] > 0 for r in rows)
    assert "flops" not in result and not list(tmp_path.iterdir())  # the dry run writes nothing
    assert "3 of 3 cells built and stepped once" in capsys.readouterr().out


def test_a_cell_that_runs_out_of_memory_does_not_fit_and_the_others_are_timed(monkeypatch):
    build = scaling.recipe_steps

    def sprint_too_big(group, device, draws=True):
        steps = build(group, device, draws)

        def out_of_memory():
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        return {**steps, "sprint": out_of_memory}

    monkeypatch.setattr(scaling, "recipe_steps", sprint_too_big)
    rows = scaling.time_group(scaling.Group("dit", "tiny", 16, 1), torch.device("cpu"), 1, 0, None, None)
    fits = {r["recipe"]: r["fits"] for r in rows}
    assert fits == {"none": True, "tread": True, "sprint": False}
    assert all(r["ms"] > 0 for r in rows if r["fits"]) and next(r for r in rows if not r["fits"])["ms"] is None
    assert "does not fit" in scaling.table(rows, timed=True)


def test_the_committed_flop_curve_covers_the_grid_and_has_its_shape():
    saved = json.loads((FIGURES / "scaling_flops.json").read_text())
    rows = {(r["family"], r["preset"], r["recipe"], r["tokens"]): r for r in saved["rows"]}
    assert set(rows) == {(f, w, r, t) for f in scaling.FAMILIES for w in scaling.WIDTHS for r in scaling.RECIPES
                         for t in scaling.TOKENS}
    assert all(r["batch"] * r["tokens"] == saved["tokens_per_step"] for r in rows.values())
    for w in scaling.WIDTHS:
        for recipe in scaling.RECIPES:
            curve = {f: [rows[f, w, recipe, t]["flops"] for t in scaling.TOKENS] for f in scaling.FAMILIES}
            for f in ("dit", "diffmoe"):  # attention: each step up in tokens costs more at equal tokens per step
                assert all(a < b for a, b in zip(curve[f], curve[f][1:])), (f, w, recipe)
            for f in ("rwkv", "mamba"):
                assert max(curve[f]) / min(curve[f]) < 1.02, (f, w, recipe)
    # Routing saves FLOPs at every point, SPRINT (75% of the tokens bypass) more than TREAD (50%).
    for f, w, t in {(f, w, t) for f, w, _, t in rows}:
        assert rows[f, w, "none", t]["flops"] > rows[f, w, "tread", t]["flops"] > rows[f, w, "sprint", t]["flops"], (f, w, t)
    assert (FIGURES / "scaling_flops.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv, says", [
    (["--tokens", "1000"], "--tokens 1000 is not a square number"),
    (["--tokens", "256", "--tokens-per-step", "1000"], "--tokens-per-step 1000 is not a multiple of --tokens 256"),
    (["--flops-only", "--dry-run"], "--flops-only and --dry-run each ask for one part"),
    (["--device", "cpu"], "--device cpu cannot time the grid; timing needs a CUDA GPU"),
    (["--families", "vit"], "invalid choice: 'vit'"),
    (["--repeats", "0"], "0 is out of range"),
])
def test_a_bad_argument_is_one_sentence_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as stopped:
        scaling.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_the_gpu_checks_opt_in_section_runs_the_dry_run(tmp_path, monkeypatch):
    from train.bench import gpu

    assert "scaling" in gpu.OPT_IN  # heavy: only when --sections names it
    monkeypatch.setattr(scaling, "FAMILIES", ("dit",))  # one family keeps the test short; the section reads the grid's
    report = gpu.main(["--dry-run", "--sections", "scaling", "--out", str(tmp_path)])
    (section,) = report["sections"]
    assert section["name"] == "scaling" and section["status"] == "measured", section["note"]
    assert [(r["family"], r["recipe"], r["tokens"], r["fits"]) for r in section["records"]] == [
        ("dit", recipe, 16, True) for recipe in scaling.RECIPES]
    md = (tmp_path / "report.md").read_text()  # the report's table of the grid, one row per cell
    assert "## Cost against tokens (train.bench.scaling)" in md and scaling.header(timed=True) in md
    assert md.count("| dit | tiny | ") == 3 and "| dit | tiny | TREAD (random) | 16 | 1 | - | - |" in md


def test_the_gpu_report_tables_the_grid_with_what_does_not_fit():
    """A fake timed section: the report's table gives each cell's ms, MFU and peak memory, and "does not fit"."""
    from train.bench import gpu_report

    def cell(family, recipe, tokens, batch, fits, ms=None, mfu=None, peak=None):
        group = scaling.Group(family, "B", tokens, batch)
        return {"section": "scaling", **scaling._row(group, recipe, flops=2e12 if fits else None, fits=fits, ms=ms, mfu=mfu,
                                                         peak_memory_bytes=peak)}

    rows = [cell("dit", "none", 256, 64, True, 40.0, 0.352, 12 * 2**30), cell("mamba", "tread", 16384, 1, True, 55.5, 0.081, 3 * 2**29),
            cell("dit", "sprint", 16384, 1, False)]
    sections = [{"name": "scaling", "title": "cost curve", "kind": "scaling", "status": "measured", "seconds": 500.0,
                 "note": "3 cells, 1 does not fit", "records": rows}]
    report = {"environment": {"device": "H100", "torch": "2.11", "cuda": "13.0", "triton": "3.6", "python": "3.12", "commit": "x"},
              "sections": sections, "goals": gpu_report.goals(sections, dry_run=False), "dry_run": False,
              "command": "python -m train.bench.gpu --sections scaling", "date": "today", "bf16": True, "compile": "model",
              "cuda_graphs": False, "budget_s": 600.0, "seconds": 500.0}
    md = gpu_report.markdown(report)
    assert "## Cost against tokens (train.bench.scaling)" in md
    assert "| dit | B | unrouted | 256 | 64 | 2000.0 | 122.1 | 40.0 | 35.2% | 12.00 |" in md
    assert "| mamba | B | TREAD (rows) | 16,384 | 1 | 2000.0 | 122.1 | 55.5 | 8.1% | 1.50 |" in md
    assert "| dit | B | SPRINT | 16,384 | 1 | - | - | does not fit | - | - |" in md
