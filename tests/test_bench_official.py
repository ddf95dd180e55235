"""`python -m train.bench.official`: our DiT beside CompVis/tread's, loaded by path from the folder --tread names.

The official code is never in this repository, so these tests write their own stand-in folder: a tiny dit.py and
routing_module.py written here from scratch that offer only the same small surface (DiT_models, get_model, DiT,
routes as dicts, enable_routing, forward(x, t, y)). They test our loader, the side-by-side step and timing, the
table and the refusals; they say nothing about the official code itself, which only a run with a real copy
measures (docs/performance.md).
"""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap

import pytest

from train.bench import gpu, gpu_report, official, official_graphs

ROUTING_MODULE = '''
import torch


class Router:
    """Keeps a random subset of the tokens; counts what it kept, so the test sees the routes it ran."""

    kept = []

    def get_mask(self, x, selection_rate=0.0):
        n = x.shape[1]
        keep = n - int(n * selection_rate)
        Router.kept.append(keep)
        return torch.rand(x.shape[0], n, device=x.device).argsort(dim=1)[:, :keep]

    def start_route(self, x, ids):
        return torch.gather(x, 1, ids[..., None].expand(-1, -1, x.shape[2]))

    def end_route(self, sub, ids, original_x):
        return original_x.scatter(1, ids[..., None].expand(-1, -1, original_x.shape[2]), sub)
'''

DIT = '''
import torch
from torch import nn

from routing_module import Router

RETURNS_DICT = {returns_dict}


class DiT(nn.Module):
    def __init__(self, input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=4, num_heads=2, num_classes=10,
                 enable_routing=False, routes=None, **unused):
        super().__init__()
        self.p = patch_size
        self.embed = nn.Linear(in_channels * patch_size ** 2, hidden_size)
        self.time = nn.Linear(1, hidden_size)
        self.label = nn.Embedding(num_classes + 1, hidden_size)
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(depth))
        self.out = nn.Linear(hidden_size, in_channels * patch_size ** 2)
        self.enable_routing, self.routes = enable_routing, list(routes or [])
        if enable_routing:
            self.router = Router()

    def forward(self, x, t, y, **kwargs):
        b, c, h, w = x.shape
        p = self.p
        x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)  # (B, N, C p p)
        x = self.embed(x) + (self.time(t[:, None].float()) + self.label(y))[:, None]
        routes = self.routes if self.training and self.enable_routing else []
        for i, block in enumerate(self.blocks):
            for r in routes:
                if i == r["start_layer_idx"]:
                    whole, ids = x, self.router.get_mask(x, r["selection_ratio"])
                    x = self.router.start_route(x, ids)
            x = x + torch.tanh(block(x))
            for r in routes:
                if i == r["end_layer_idx"]:
                    x = self.router.end_route(x, ids, original_x=whole)
        x = self.out(x).reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)  # (B, C, H, W)
        return {{"x": x}} if RETURNS_DICT else x


DiT_models = {{"DiT-S/2": lambda **kw: DiT(hidden_size=384, depth=12, num_heads=6, patch_size=2, **kw)}}


def get_model(name, params):
    return DiT_models[name](**params)
'''


def stand_in(folder, returns_dict: bool = False, dit: str | None = None, routing: bool = True):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dit.py").write_text(textwrap.dedent(DIT.format(returns_dict=returns_dict) if dit is None else dit))
    if routing:
        (folder / "routing_module.py").write_text(ROUTING_MODULE)
    return folder


TINY = ["--presets", "tiny", "--input-size", "8", "--batch", "2", "--repeats", "1", "--warmup", "0", "--threads", "1"]


@pytest.mark.parametrize("returns_dict", [False, True])
def test_both_sides_run_the_same_route_and_the_table_is_printed(tmp_path, capsys, monkeypatch, returns_dict):
    folder = stand_in(tmp_path / "tread", returns_dict)
    loaded = []
    load = official.load_official
    monkeypatch.setattr(official, "load_official", lambda f: loaded.append(load(f)) or loaded[-1])
    (row,) = official.main(["--tread", str(folder), *TINY])
    out = capsys.readouterr().out
    # Loaded by path and left nothing behind: the folder is off sys.path, its routing_module out of sys.modules.
    assert str(folder) not in sys.path and "routing_module" not in sys.modules
    # The official side ran routed with our config's route (tiny: depth 8, r2->4, half of 16 tokens kept).
    assert row["route"] == "r2->4 x0.5" and loaded[0].Router.kept and set(loaded[0].Router.kept) == {8}
    assert row["built"] == "DiT(**PRESETS['tiny'])"  # the stand-in, like the official code, names no tiny DiT
    for kind in ("unrouted", "routed"):
        assert row[f"ms_official_{kind}"] > 0 and row[f"ms_ours_{kind}"] > 0
        assert row[f"ratio_{kind}"] == pytest.approx(row[f"ms_ours_{kind}"] / row[f"ms_official_{kind}"])
    # The copy measured is named by its files' hash, so a report says which version of the official code it timed.
    digest = hashlib.sha256((folder / "dit.py").read_bytes() + (folder / "routing_module.py").read_bytes()).hexdigest()[:12]
    assert row["official_sha256"] == digest and f"files sha256 {digest}" in out
    # Ours as `python -m train` runs it: no fp32 block after the route (the config's default); TF32 is on on CUDA only.
    assert not row["fp32_after_route"] and "routing.fp32_after_route=false" in out and "| official ms | ours ms | ours / official | MFU ours |" in out
    assert "| DiT-tiny/2 | r2->4 x0.5 | 2 | routed |" in out and "(goal <= 0.8x)" in out and "first unrouted + routed steps" in out
    # Three rounds, each side's saving beside what its own FLOPs predict (the stand-in's FLOPs: its blocks are
    # Linear layers on half the tokens), and the ratio's range.
    assert len(row["rounds"]["ratio_routed"]) == 3 and "3 rounds" in out
    assert row["ratio_routed"] == pytest.approx(row["ms_ours_routed"] / row["ms_official_routed"])
    assert row["gflops_official"]["routed"] < row["gflops_official"]["unrouted"]
    assert 0 < row["ideal_saving_official"] < 0.5 and 0 < row["ideal_saving_ours"] < 0.5
    for side in ("official", "ours"):
        assert f"routing saves {side} " in out and len(row["rounds"][f"saving_{side}"]) == 3
        assert row[f"efficiency_{side}"] == pytest.approx(row[f"ms_{side}_unrouted"] / row[f"ms_{side}_routed"]
                                                          / (row[f"gflops_{side}"]["unrouted"] / row[f"gflops_{side}"]["routed"]))
    assert "ours / official routed: " in out and row["profile"] is None


def test_ours_can_run_the_fp32_block_after_the_route_as_the_official_forward_does(tmp_path, capsys):
    (row,) = official.main(["--tread", str(stand_in(tmp_path / "tread")), *TINY, "--rounds", "1", "--fp32-after-route", "--profile"])
    out = capsys.readouterr().out
    assert row["fp32_after_route"] and "routing.fp32_after_route=true" in out
    # --profile: one step of each of the four, its costliest launches (the CPU's ops here) and the kinds' shares.
    assert set(row["profile"]) == {"official unrouted", "ours unrouted", "official routed", "ours routed"}
    for prof in row["profile"].values():
        assert prof["top"] and sum(prof["shares"].values()) == pytest.approx(1.0) and "matmul" in prof["shares"]
    assert "official routed step: " in out and "ours routed step: " in out


# A stand-in whose blocks compile themselves and whose block after a route runs with CUDA's autocast off, as the
# official forward's do (written here; the same three signatures reach the compiled block in a routed step).
COMPILED_DIT = '''
import torch
from torch import nn

from routing_module import Router


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attn = nn.Linear(width, width)

    @torch.compile
    def forward(self, x):
        return x + torch.tanh(self.attn(x))


class DiT(nn.Module):
    def __init__(self, input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=4, num_heads=2, num_classes=10,
                 enable_routing=False, routes=None, **unused):
        super().__init__()
        self.p = patch_size
        self.embed = nn.Linear(in_channels * patch_size ** 2, hidden_size)
        self.blocks = nn.ModuleList(Block(hidden_size) for _ in range(depth))
        self.out = nn.Linear(hidden_size, in_channels * patch_size ** 2)
        self.enable_routing, self.route, self.router = enable_routing, routes[0], Router()

    def forward(self, x, t, y):
        b, c, h, w = x.shape
        p = self.p
        x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)  # (B, N, C p p)
        x = self.embed(x).float()
        routed, fp32_next = self.training and self.enable_routing, False
        for i, block in enumerate(self.blocks):
            if routed and i == self.route["start_layer_idx"]:
                whole, ids = x, self.router.get_mask(x, self.route["selection_ratio"])
                x = self.router.start_route(x, ids)
            if fp32_next:
                with torch.amp.autocast(device_type="cuda", enabled=False):
                    x = block(x)
                fp32_next = False
            else:
                x = block(x)
            if routed and i == self.route["end_layer_idx"]:
                x, fp32_next = self.router.end_route(x, ids, original_x=whole), True
        return self.out(x).reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)  # (B, C, H, W)


DiT_models = {}


def get_model(name, params):
    return DiT_models[name](**params)
'''


def test_the_graph_ledger_names_the_graph_each_official_block_call_ran(tmp_path, capsys, monkeypatch):
    """train.bench.official_graphs on a stand-in: which compiled graph served each block call, unrouted and routed."""
    monkeypatch.setattr(official_graphs, "compile_fx", lambda gm, example_inputs: gm.forward)  # dynamo's graphs, run eager
    folder = stand_in(tmp_path / "tread", dit=COMPILED_DIT)
    ledger = official_graphs.main(["--tread", str(folder), "--depth", "8", "--width", "16", "--heads", "1",
                                   "--input-size", "8", "--steps", "2"])
    out = capsys.readouterr().out
    graphs, calls = ledger["graphs"], ledger["calls"]

    def served(step):  # {graph: block calls} of one step
        return {int(key.split("graph ")[1]): n for key, n in calls.items() if key.startswith(step + " |")}

    # Unrouted, every block runs a graph under autocast; the first step compiles one for the whole sequence.
    (whole,) = served("unrouted 1")
    assert served("unrouted 1")[whole] == 8 and not graphs[whole]["symbolic"] and graphs[whole]["modules"] == ["attn"]
    assert sum(served("unrouted 2").values()) == 8 and all(graphs[g]["autocast"] for g in served("unrouted 2"))
    # Routed (r2->4): the routed blocks on a recompile with a symbolic token count, block 5 (after the route, CUDA's
    # autocast off, here applied to the CPU's) on a graph of its own without autocast; nothing compiles after step 1.
    routed = served("routed 2")
    off = [g["graph"] for g in graphs if not g["autocast"]]
    assert len(off) == 1 and routed[off[0]] == 1 and sum(routed.values()) == 8 and len(graphs) == 3
    assert any(graphs[g]["symbolic"] and graphs[g]["autocast"] for g in routed)
    assert "| routed 2 |" in out and "graphs per compiled code object: {'0': 3}" in out


@pytest.mark.parametrize("args, says", [(["--tread", "no-such-folder"], "is not a folder"),
                                        (["--tread", ".", "--width", "30", "--heads", "4"], "--width 30 is not divisible by --heads 4")])
def test_the_graph_ledger_refuses_bad_arguments_in_one_sentence(capsys, args, says):
    with pytest.raises(SystemExit) as stop:
        official_graphs.main(args)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and says in err and "Traceback" not in err


def _fair_row(saving_official, ideal_official, efficiency_official, efficiency_ours=0.9):
    return {"saving_official": saving_official, "ideal_saving_official": ideal_official,
            "efficiency_official": efficiency_official, "efficiency_ours": efficiency_ours}


def test_the_ratio_is_not_used_where_the_official_routing_does_not_save_in_this_harness():
    # The H100 run at 48e6353: the official side saved 8% where its FLOPs predicted 42%: its efficiency 0.53.
    fair, why = official.fairness(_fair_row(0.08, 0.42, 0.53, 0.80))
    assert not fair and "saved the official side 8% of its step where its FLOPs predict 42%" in why and "0.27 from ours" in why
    assert official.fairness(_fair_row(0.30, 0.42, 0.85)) == (True, "")
    # A small saving where the FLOPs predict little is no sign of a broken harness; efficiencies 0.1 apart still are.
    assert official.fairness(_fair_row(0.15, 0.30, 0.85)) == (True, "")
    fair, why = official.fairness(_fair_row(0.30, 0.42, 0.75, 0.90))
    assert not fair and "0.15 from ours" in why and "saved" not in why


def test_a_paper_size_is_built_by_its_official_name(tmp_path):
    module = official.load_official(stand_in(tmp_path / "tread"))
    dit, built = official.build_official(module, "S", 8, 4, 2, 1000, [])
    assert built == "get_model('DiT-S/2')" and len(dit.blocks) == 12


@pytest.mark.parametrize("case, says", [
    ("no folder", "is not a folder"),
    ("no routing_module.py", "has no routing_module.py"),
    ("no files", "has no dit.py or routing_module.py"),
    ("no get_model", "does not define get_model"),
    ("dit.py imports a missing package", "could not import no_such_package"),
])
def test_a_folder_without_the_official_files_is_refused_in_one_sentence(tmp_path, capsys, case, says):
    folder = tmp_path / "tread"
    if case == "no routing_module.py":
        stand_in(folder, routing=False)
    elif case == "no files":
        folder.mkdir()
    elif case == "no get_model":
        stand_in(folder, dit="import torch\nDiT_models = {}\nclass DiT(torch.nn.Module):\n    pass\n")
    elif case == "dit.py imports a missing package":
        stand_in(folder, dit="import no_such_package\n")
    with pytest.raises(SystemExit) as stop:
        official.main(["--tread", str(folder), *TINY])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert says in err and "--tread" in err
    if case != "dit.py imports a missing package":
        assert "dit.py and routing_module.py" in err  # what to put there
    assert str(folder) not in sys.path


def test_the_gpu_check_refuses_a_bad_tread_folder_before_running(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--dry-run", "--out", str(tmp_path / "out"), "--tread", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "--tread" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out" / "report.json").exists()


def test_the_gpu_check_runs_the_side_by_side_section_and_lists_its_goals(tmp_path):
    report = gpu.main(["--dry-run", "--sections", "dit-XL-official", "--out", str(tmp_path / "out"), "--tread", str(stand_in(tmp_path / "tread"))])
    (section,) = report["sections"]
    assert section["status"] == "measured", section["note"]
    assert section["records"][0]["preset"] == "tiny" and section["records"][0]["ratio_routed"] > 0
    assert len(section["records"][0]["rounds"]["ratio_routed"]) == 3
    goals = [g for g in report["goals"] if "CompVis/tread" in g["goal"]]
    assert len(goals) == 1 and all(g["verdict"] == "not measured" for g in goals)  # a dry run decides none
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Side by side with CompVis/tread's DiT" in md and "| DiT-tiny/2 (16 tokens) | r2->4 x0.5 |" in md
    assert "| official saving (its FLOPs predict) | our saving (our FLOPs predict) |" in md
    assert json.loads((tmp_path / "out" / "report.json").read_text())["goals"] == report["goals"]


def test_the_official_row_decides_the_side_by_side_goal_and_our_dit_xl_goals():
    row = {"section": "dit-XL-official", "ratio_routed": 0.75, "mfu_routed": 0.40, "mfu_unrouted": 0.46, "compile_s": 95.0,
           "efficiency": 0.92, "fair": True, "rounds": {"ratio_routed": [0.74, 0.75, 0.77], "mfu_routed": [0.39, 0.40, 0.41],
                                                        "mfu_unrouted": [0.455, 0.46, 0.47], "efficiency": [0.91, 0.92, 0.93]}}
    sections = [{"name": "dit-XL-official", "status": "measured", "records": [row]}]
    verdicts = {g["goal"]: g["verdict"] for g in gpu_report.goals(sections, dry_run=False)
                if "DiT-XL/2 TREAD" in g["goal"] and "batch 128" not in g["goal"]}
    assert verdicts == {"DiT-XL/2 TREAD beside CompVis/tread's DiT: routed step at most 0.8x the official one": "met",
                        "DiT-XL/2 TREAD, batch 64: routed MFU >= 40%": "undecided",
                        "DiT-XL/2 TREAD, batch 64: unrouted MFU >= 45%": "met",
                        "DiT-XL/2 TREAD: routed efficiency >= 0.9": "met",
                        "DiT-XL/2 TREAD: whole-model compile (the first unrouted and routed steps) under 90 s": "missed"}
