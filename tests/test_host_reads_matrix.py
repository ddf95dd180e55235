"""No host read in a training step's model work, over the whole matrix: every family x every routing recipe (its
configs/routing/*.yaml) x align none / self (the EMA teacher) / repa x unmasked or masked data (a force-keep mask on
every route, as the fine-tunes' masks give). The step is the trainer's: the objective's loss on the wrapped network,
the alignment on the same forward, the backward (tests/host_reads.py records the reads: aten ops and Python methods).

The default run samples the matrix so every value of every axis runs at least once (a few seconds); `-m slow` runs all
of it. The trainer around the model (guard, optimizer, EMA, logging) is tests/test_host_sync.py's.
"""

from __future__ import annotations

import copy
import itertools
from functools import partial
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from backbones import build_backbone
from backbones.align import Alignment
from edm import build_objective
from host_reads import HostReads
from routing import ForceKeep, Router, build_policy, resolve_routes
from test_align import vit_file  # noqa: F401  (the random tiny ViT REPA's encoder loads)
from train.metrics.encoder import FrozenEncoder

ROUTINGS = Path(__file__).resolve().parent.parent / "configs" / "routing"
FAMILIES = {"dit": {}, "rwkv": {}, "mamba": {}, "diffmoe": {"num_experts": 4},
            "diffmoe-token_choice": {"num_experts": 4, "moe_mode": "token_choice"},
            "diffmoe-expert_choice": {"num_experts": 4, "moe_mode": "expert_choice"}}
RECIPES = sorted(p.stem for p in ROUTINGS.glob("*.yaml"))
ALIGNS = ("none", "self", "online", "repa")  # self: the EMA teacher (SRA); online: this forward's block (LayerSync)
MASKS = (False, True)
DEPTH = 8  # TREAD's r2->-4 route holds blocks 2-4, SPRINT's r2->-3 blocks 2-5
# The reads the matrix allows, by (what, `path function`), each with why it is inherent: a shape that follows the data.
INHERENT = {
    ("Tensor.__float__", "backbones/ops/wkv.py _chunking"):
        "the chunked Bi-WKV op, the CPU path and CUDA's without Triton (CUDA runs the Triton kernels, whose chunks are a fixed 16 "
        "tokens): its chunk length, and so the shape of every matmul and the number of carry steps, follows max |w|, which "
        "keeps each chunk's decays inside e^+-12",
    ("aten.nonzero", "backbones/ops/moe.py _token_choice"):
        "token choice (the MoE table's baseline), dropless: each expert's matmul takes the tokens that chose it, a load that "
        "follows the gate (expert choice and DiffMoE's capacity routing have fixed loads and read nothing)",
}


def full_matrix() -> list[tuple]:
    return list(itertools.product(FAMILIES, RECIPES, ALIGNS, MASKS))


def sampled_matrix() -> list[tuple]:
    """Every family, recipe, alignment and mask at least once: recipe i with family i, alignment i and mask i (mod)."""
    families, n = list(FAMILIES), max(len(FAMILIES), len(RECIPES))
    return [(families[i % len(families)], RECIPES[i % len(RECIPES)], ALIGNS[i % len(ALIGNS)], MASKS[i % 2]) for i in range(n + 1)]


def model(family: str, recipe: str, seed: int = 0) -> nn.Module:
    """A 16x16 one-channel model on a 4x4 token grid with the recipe's routes (configs/routing/<recipe>.yaml)."""
    torch.manual_seed(seed)
    name = family.split("-")[0]
    net = build_backbone(name, "tiny", input_size=16, in_channels=1, patch_size=4, num_classes=10, depth=DEPTH, hidden_size=32,
                         **FAMILIES[family])
    r = OmegaConf.load(ROUTINGS / f"{recipe}.yaml")
    routes = OmegaConf.to_container(r.routes) or []
    if routes:
        net.attach_router(Router(build_policy(r.policy, **(r.get("policy_kwargs") or {})), resolve_routes(routes, DEPTH)))
    return net.train()


def masked(net: nn.Module, keep: torch.Tensor, host_copy: bool = True) -> None:
    """Every route of `net` keeps the tokens `keep` (B, N) marks, as a fine-tune's data mask does (routing.policy): with
    its host copy, made where the mask is made (the trainer's data loader), so a route's subset size reads no device."""
    net.router.run = partial(type(net.router).run, net.router, force_keep=ForceKeep.of(keep) if host_copy else keep)


def step(family: str, recipe: str, align: str, mask: bool, encoder=None, plant=None, host_copy: bool = True) -> HostReads:
    """One training step's model work (forward, alignment, backward) with host reads recorded; `plant` runs inside it;
    `host_copy=False` gives the routes a bare mask tensor (no ForceKeep), which they must read to size their subsets."""
    objective = build_objective("edm")
    backbone = model(family, recipe)
    net = objective.wrap(backbone)
    ema = copy.deepcopy(net).eval().requires_grad_(False) if align == "self" else None
    alignment = None
    if align != "none":
        # Student block 2, in every route; the online teacher block 3 in the student's route, the EMA's SRA's (4).
        alignment = Alignment(backbone, "self" if align == "online" else align, 2, width=16, teacher_layer=3 if align == "online" else None,
                              teacher="online" if align == "online" else "ema", target_dim=encoder.dim if align == "repa" else None,
                              targets=encoder)
    g = torch.Generator().manual_seed(1)
    b = 4
    y, labels = torch.rand(b, 1, 16, 16, generator=g) * 2 - 1, torch.randint(0, 10, (b,), generator=g)
    sigma, noise, u = objective.sample_time(b, g), torch.randn(b, 1, 16, 16, generator=g), torch.rand(b, generator=g)
    if mask:
        masked(backbone, torch.rand(b, 16, generator=g) < 0.3, host_copy)
    with HostReads() as reads:
        loss = objective.loss(net, y, labels, sigma, noise).mean()
        if alignment is not None:
            loss = loss + alignment(y, labels, sigma, noise, objective=objective, ema=ema, u=u)
        if plant is not None:
            plant(loss)
        loss.backward()
    return reads


def unexpected(reads: HostReads) -> list[tuple[str, str]]:
    """The reads that INHERENT does not name (`at` is `path:line function`)."""
    return [(what, at) for what, at in reads.reads if (what, f"{at.split(':')[0]} {at.split(' ', 1)[-1]}") not in INHERENT]


@pytest.fixture(scope="module")
def encoder(vit_file):  # noqa: F811
    _, path = vit_file
    return FrozenEncoder.load("vit_tiny_patch16_224", str(path), 64, (4, 4), "cpu", torch.float32)


def check(cell, encoder) -> None:
    reads = step(*cell, encoder=encoder if cell[2] == "repa" else None)
    assert not unexpected(reads), f"{'-'.join(map(str, cell))}: host reads in the step: {reads.summary()}"


@pytest.mark.parametrize("cell", sampled_matrix(), ids=lambda c: "-".join(map(str, c)))
def test_a_step_reads_nothing_on_the_host(cell, encoder):
    check(cell, encoder)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [c for c in full_matrix() if c not in sampled_matrix()], ids=lambda c: "-".join(map(str, c)))
def test_a_step_reads_nothing_on_the_host_full_matrix(cell, encoder):
    check(cell, encoder)


def test_a_planted_item_is_found_where_it_is():
    """The test of the test: one `.item()` inside the step fails the check and is named at its line."""
    reads = step("dit", "random", "none", False, plant=lambda loss: loss.detach().item())
    assert [what for what, _ in unexpected(reads)] == ["Tensor.item"], reads.summary()
    assert unexpected(reads)[0][1].startswith("tests/test_host_reads_matrix.py:")
    assert not unexpected(step("dit", "random", "none", False))


@pytest.mark.parametrize("recipe", ["random", "structured"])
def test_a_mask_without_its_host_copy_is_a_read_the_matrix_finds(recipe):
    """The masked cells pass because the mask comes with its host copy (routing.policy.ForceKeep), as the trainer's data
    loader gives it: a bare mask tensor must be read back to size a route's subset, and the check names that read."""
    reads = unexpected(step("dit", recipe, "none", True, host_copy=False))
    assert reads and all(at.split(":")[0] == "routing/policy.py" for _, at in reads), reads
    assert not unexpected(step("dit", recipe, "none", True))
