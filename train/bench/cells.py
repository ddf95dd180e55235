"""The grid of the cross-backbone table: one cell per (backbone, routing, alignment, seed), each a real training config."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict

from backbones import family_module
from routing import ConfigError, build_policy


@dataclass
class Cell:
    """One training run of the grid: a (backbone, routing) pair at one seed, with its composed config."""

    backbone: str
    routing: str
    seed: int
    cfg: DictConfig
    ablation: bool  # an unstructured subset on a scan-order backbone (TREAD's 1-D ablation)
    plain: dict = field(default_factory=dict)  # the config `backbone=<family> routing=<r> data=<dataset>` composes to: the defaults of keys added later
    align: str = "none"  # representation alignment: none, or an entry of grid.aligns (an align group or a variant of one)
    align_label: str | None = None  # how the tables name the alignment (grid.align_labels; None: its name)

    @property
    def key(self) -> str:
        return cell_key(self.backbone, self.routing, self.align)

    @property
    def recipe(self) -> str:
        """The routing, with the alignment beside it when there is one ("random + self"): the tables' and plots' label."""
        return recipe_label(self.routing, self.align_label or self.align)

    @property
    def name(self) -> str:
        return f"{self.key}-s{self.seed}"


def cell_key(backbone: str, routing: str, align: str = "none") -> str:
    """`dit-random`, or `dit-random-self` with alignment: align=none keeps the keys (and committed files) from before."""
    return f"{backbone}-{routing}" if align == "none" else f"{backbone}-{routing}-{align}"


def recipe_label(routing: str, align: str = "none") -> str:
    return routing if align == "none" else f"{routing} + {align}"


def align_group(bench: DictConfig, align: str) -> tuple[str, list[str]]:
    """The config group of a grid.aligns entry and its extra overrides: `grid.align_overrides.<align>`, whose
    `align=<group>` entry makes the name a variant of that group (e.g. sra_w0.2: [align=self, align.weight=0.2]); without
    one the name is the group itself."""
    extra = [str(o) for o in (bench.grid.get("align_overrides") or {}).get(align) or []]
    groups = [o.split("=", 1)[1] for o in extra if o.startswith("align=")]
    return (groups[-1] if groups else align), [o for o in extra if not o.startswith("align=")]


def align_label(bench: DictConfig, align: str) -> str | None:
    """How the tables name a grid.aligns entry (`grid.align_labels`), e.g. "self, weight 2 (not SRA's)"; None: its name."""
    return (bench.grid.get("align_labels") or {}).get(align)


def is_ablation(cfg: DictConfig) -> bool:
    """True when the routing picks tokens without a grid for blocks that scan one."""
    if not cfg.routing.routes:
        return False
    policy = build_policy(cfg.routing.policy, **(cfg.routing.get("policy_kwargs") or {}))
    return family_module(cfg.backbone.name).Block.needs_grid and not policy.yields_grid


@functools.lru_cache(maxsize=1024)
def _composed(search_path: tuple[tuple[str, str], ...], overrides: tuple[str, ...]) -> DictConfig:
    return compose(config_name="config", overrides=list(overrides))


def _cached(overrides: list[str]) -> DictConfig:
    """The shared composed config of the current search path; callers must not change it."""
    path = tuple((e.provider, e.path) for e in GlobalHydra.instance().config_loader().get_search_path().get_path())
    return _composed(path, tuple(overrides))


def compose_config(overrides: list[str]) -> DictConfig:
    """`compose(config_name="config", overrides)`, once per process for each search path and list of overrides.

    Composing costs 0.1-0.5 s of CPU, and a process composes the same pair again and again: every bench run in one
    process (the tests run dozens), the cost table's unrouted bases. Each caller gets its own copy to change.
    """
    return copy.deepcopy(_cached(overrides))


def compose_pair(bench: DictConfig, backbone: str, routing: str, align: str = "none") -> tuple[DictConfig, bool, dict]:
    """The real training config (configs/config.yaml) of one grid pair with the bench's sizes, whether the pair is an
    ablation, and the pair's config without the bench's overrides (the defaults its cost is compared with).

    `backbone` is a row name of the grid: a family (dit, rwkv, ...) or a variant whose `sizes.<name>` names its
    family, e.g. `tc: {family: diffmoe, kwargs: {moe_mode: token_choice}}` (the MoE table's baselines).
    `align` other than none adds `align=<group>` and the bench's `grid.align_overrides.<align>` (e.g. a projector
    width for the bench's small models, or a variant's weight: align_group); align=none composes exactly what it did
    before alignment existed.
    """
    size = OmegaConf.to_container(bench.sizes.get(backbone) or OmegaConf.create({}))
    family = size.pop("family", backbone)
    group, extra = align_group(bench, align) if align != "none" else ("none", [])
    groups = [f"backbone={family}", f"routing={routing}", f"data={bench.dataset}"] + ([f"align={group}"] if align != "none" else [])
    try:
        cfg = compose_config([*groups, *bench.overrides, *extra])
        plain = OmegaConf.to_container(_cached(groups), resolve=True)  # a new container: no copy needed
    except (MissingConfigException, OverrideParseException, ConfigCompositionException) as err:
        raise ConfigError(f"{str(err).splitlines()[0]} (check grid.backbones, grid.routings, grid.aligns, dataset, overrides and grid.align_overrides).") from err
    with open_dict(cfg):
        cfg.backbone = OmegaConf.merge(cfg.backbone, size)
    return cfg, is_ablation(cfg), plain


def compose_cell(bench: DictConfig, backbone: str, routing: str, seed: int, pair: tuple[DictConfig, bool, dict],
                 align: str = "none") -> Cell:
    """One seed of a composed pair, with the bench's budget and run folder."""
    cfg, ablation, plain = pair
    cfg = copy.deepcopy(cfg)  # the seeds of a pair share its composition; each gets its own config
    t = bench.train
    with open_dict(cfg):
        cfg.merge_with({
            "seed": seed,
            "run_dir": str(Path(bench.out_dir) / "runs" / f"{cell_key(backbone, routing, align)}-s{seed}"),
            "routing": {"allow_unstructured": bool(cfg.routing.allow_unstructured or ablation)},
            "trainer": {"max_minutes": t.minutes, "max_steps": t.max_steps, "batch_size": t.batch_size,
                        "log_every": t.log_every, "sample_every": 0, "cpu": bench.device == "cpu",
                        # Checkpoints every eval.every steps feed the quality-vs-steps curve; all are kept until scored.
                        # eval.keep_final alone needs only the one the trainer writes at the last step.
                        "ckpt_every": bench.eval.get("every") or (10**9 if bench.eval.get("keep_final") else 0),
                        "keep_checkpoints": 10**9},
        })
    return Cell(backbone, routing, seed, cfg, ablation, plain, align, align_label(bench, align) if align != "none" else None)


def aligned_pairs(bench: DictConfig, align: str) -> list[str] | None:
    """The pairs `grid.aligned` gives an alignment: a list for every alignment, or a mapping alignment -> list (an
    alignment it does not name: every pair); None: every pair."""
    aligned = bench.grid.get("aligned")
    if isinstance(aligned, DictConfig):
        aligned = aligned.get(align)
    return None if aligned is None else list(aligned)


def align_seeds(bench: DictConfig, align: str) -> list[int]:
    """The seeds an alignment trains: `grid.align_seeds.<align>` (e.g. a sweep on two seeds), else `seeds`."""
    mine = (bench.grid.get("align_seeds") or {}).get(align)
    if mine is None:
        return list(bench.seeds)
    stray = sorted(set(mine) - set(bench.seeds))
    if stray:
        raise ConfigError(f"grid.align_seeds.{align} holds seed {stray[0]}, which is not in seeds={list(bench.seeds)}; name seeds of the bench.")
    return [s for s in bench.seeds if s in mine]


def grid_pairs(bench: DictConfig) -> list[tuple[str, str, str]]:
    """(backbone, routing, align) of every pair of the grid: backbones x routings x `grid.aligns` (default [none]),
    less `grid.skip`; an alignment other than none only on the pairs `grid.aligned` names for it (aligned_pairs)."""
    skip = set(bench.grid.get("skip") or [])
    aligns = list(bench.grid.get("aligns") or ["none"])
    pairs = {f"{b}-{r}" for b in bench.grid.backbones for r in bench.grid.routings if f"{b}-{r}" not in skip}
    named = {a: aligned_pairs(bench, a) for a in aligns if a != "none"}
    stray = sorted({p for mine in named.values() for p in mine or []} - pairs)
    if stray:
        raise ConfigError(f"grid.aligned names {stray[0]!r}, which is not a pair of this grid (grid.backbones x grid.routings "
                          "less grid.skip); name <backbone>-<routing> pairs of the grid, or set grid.aligned=null for every pair.")
    return [(b, r, a) for a in aligns for b in bench.grid.backbones for r in bench.grid.routings
            if f"{b}-{r}" not in skip and (a == "none" or named[a] is None or f"{b}-{r}" in named[a])]


def grid_cells(bench: DictConfig) -> list[Cell]:
    """Every (backbone, routing, align, seed) of the grid, seed-major so a partial run covers every pair evenly.

    `grid.skip` drops pairs ("rwkv-random"), e.g. the 1-D ablations when CPU time is short; the pairs in `grid.last`
    come after every seed of the others, so a bench cut short has spread where it matters most. Within a seed the
    aligned pairs follow the unaligned ones (a grid.last key names either, e.g. `dit-rows` or `dit-random-self`).
    """
    last = list(bench.grid.get("last") or [])
    pairs = grid_pairs(bench)
    # Each pair is composed once, not once per seed (compose_config caches across calls too).
    composed = {pair: compose_pair(bench, *pair) for pair in pairs}
    order = [p for p in pairs if cell_key(*p) not in last], [p for p in pairs if cell_key(*p) in last]
    seeds = {a: align_seeds(bench, a) for a in dict.fromkeys(a for _, _, a in pairs)}
    return [compose_cell(bench, b, r, s, composed[(b, r, a)], a) for group in order for s in bench.seeds for b, r, a in group
            if s in seeds[a]]


def pair_cells(cells: list[Cell]) -> list[Cell]:
    """The first cell of each pair, in the grid's order: the one its cost is measured with (an alignment trained on
    some seeds only, grid.align_seeds, may lack the first seed)."""
    first: dict[str, Cell] = {}
    for cell in cells:
        first.setdefault(cell.key, cell)
    return list(first.values())


def set_step_budget(cell: Cell, steps: int | None, speedup: float | None) -> None:
    """Equal compute as a step count: the unrouted cell trains `steps` steps, a routed one `steps` x its
    measured speedup (interleaved median step times of the cost phase, at the training shape).

    On a shared machine a wall-clock budget charges other people's jobs to whichever cell is running; the
    step-time ratio comes from round-robin medians, so a burst of load hits every cell of the ratio alike.
    """
    if steps is None:
        return
    with open_dict(cell.cfg):
        cell.cfg.trainer.max_minutes = None
        cell.cfg.trainer.max_steps = max(1, round(steps * (speedup or 1.0)))
