"""DiffMoE family: capacities, routing modes, the capacity predictor, dense equivalence, TREAD over MoE, DDP."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backbones import build_backbone
from backbones.diffmoe import (
    Block,
    activated_parameters,
    auxiliary_losses,
    capacity_stats,
    moe_layers,
    set_inference_capacity,
)
from backbones.dit import Block as DiTBlock
from backbones.ops.moe import MoE
from routing import ConfigError, Route, Router
from routing.policy import RandomRouting

D, H, E = 32, 64, 4


def make_moe(mode: str, **kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, H, E, mode, **kw)
    # A wider gate than N(0, 0.006) makes top-k choices decisive, and the test independent of near-ties.
    torch.nn.init.normal_(moe.gate_weight, std=0.5)
    return moe


def expert_out(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    return moe.experts.one(e, x)


@pytest.mark.parametrize("b, n, capacity", [(2, 13, 1.0), (3, 16, 2.0), (2, 10, 0.5)])
def test_global_pool_training_gives_every_expert_exactly_its_capacity(b, n, capacity):
    moe = make_moe("global_pool", capacity=capacity).train()
    x = torch.randn(b, n, D)
    out = moe(x)
    k = int(b * n / E * capacity)  # the pool is the whole batch, S = B * N
    assert moe.last_mask.sum((0, 1)).tolist() == [k] * E
    # Output = sum over the experts that took the token of score * expert(x), checked token by token.
    tokens, scores = x.view(-1, D), torch.softmax(x.view(-1, D) @ moe.gate_weight.t(), -1)  # (B, N, D) -> (S, D)
    mask = moe.last_mask.view(-1, E)  # (B, N, E) -> (S, E)
    expected = sum(mask[:, e, None] * scores[:, e, None] * expert_out(moe, e, tokens) for e in range(E))
    torch.testing.assert_close(out.view(-1, D), expected, rtol=1e-5, atol=1e-6)  # (B, N, D) -> (S, D)


def test_global_pool_mixes_samples():
    """The pool spans the batch: a sample whose tokens score high for expert 0 takes more of its slots."""
    moe = make_moe("global_pool").train()
    x = torch.randn(2, 16, D)
    x[1] += 3 * moe.gate_weight[0]  # sample 1 leans towards expert 0
    moe(x)
    taken = moe.last_mask[..., 0].sum(1)  # (B,) tokens of each sample taken by expert 0
    assert taken[1] > taken[0] and taken.sum() == 2 * 16 // E


def test_untaken_tokens_pass_through_the_residual_unchanged():
    torch.manual_seed(0)
    block = Block(D, 1, 2, num_heads=4, moe_mode="global_pool", num_experts=E, capacity=0.5)
    for p in block.adaLN.parameters():  # leave adaLN-Zero's start so the MoE branch counts
        torch.nn.init.normal_(p, std=0.5)
    x, c = torch.randn(2, 12, D), torch.randn(2, D)
    records = {}
    block.mlp.register_forward_hook(lambda m, i, o: records.update(out=o, mask=m.last_mask))
    out = block(x, c, None)
    untaken = ~records["mask"].any(-1)  # (B, N)
    assert untaken.sum() > 0 and (~untaken).sum() > 0
    assert records["out"][untaken].abs().max() == 0  # the MoE contributes exactly 0
    # The block output of an untaken token is exactly its value after attention (the residual).
    block.mlp.forward = lambda h: torch.zeros_like(h)
    no_moe = block(x, c, None)
    assert torch.equal(out[untaken], no_moe[untaken])
    assert not torch.allclose(out[~untaken], no_moe[~untaken])


def test_shared_experts_are_always_on():
    moe = make_moe("global_pool", capacity=0.5, shared_experts=1).train()
    x = torch.randn(2, 8, D)
    out = moe(x)
    untaken = ~moe.last_mask.any(-1)  # (B, N)
    assert untaken.any()
    torch.testing.assert_close(out[untaken], moe.shared(x)[untaken])


def test_token_choice_respects_top_k_and_records_a_balance_loss():
    moe = make_moe("token_choice", top_k=2).train()
    x = torch.randn(2, 9, D)
    out = moe(x)
    tokens = x.view(-1, D)  # (B, N, D) -> (S, D)
    scores = torch.softmax(tokens @ moe.gate_weight.t(), -1)  # (S, E)
    mask = moe.last_mask.view(-1, E)  # (B, N, E) -> (S, E)
    assert mask.sum(-1).tolist() == [2] * 18
    assert torch.equal(mask, torch.zeros_like(mask).scatter_(1, scores.topk(2, -1).indices, True))
    expected = sum(mask[:, e, None] * scores[:, e, None] * expert_out(moe, e, tokens) for e in range(E))
    torch.testing.assert_close(out.view(-1, D), expected, rtol=1e-5, atol=1e-6)  # (B, N, D) -> (S, D)
    f = mask.float().mean(0) / 2
    torch.testing.assert_close(moe.aux_losses["balance"], E * (f * scores.mean(0)).sum())
    assert capacity_stats(moe)["mean"] == 2


def test_expert_choice_is_per_sample():
    moe = make_moe("expert_choice").train()
    x = torch.randn(2, 16, D)
    out = moe(x)
    mask = moe.last_mask.clone()
    assert mask.sum(1).tolist() == [[16 // E] * E] * 2  # each expert takes k = N / E tokens of every sample
    y = x.clone()
    y[1] = 5 * torch.randn(16, D)
    out_y = moe(y)
    assert torch.equal(moe.last_mask[0], mask[0]) and not torch.equal(moe.last_mask[1], mask[1])
    torch.testing.assert_close(out_y[0], out[0])


@pytest.mark.parametrize("target", [0.5, 1.0, 2.5])
def test_target_capacity_is_reached_on_the_batch(target):
    """A target average capacity picks the threshold on the batch; tolerance: one (token, expert) pair."""
    moe = make_moe("global_pool")
    for p in moe.predictor.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.eval().inference_target = target
    x = torch.randn(3, 20, D)
    with torch.no_grad():
        moe(x)
    assert abs(float(moe.last_load.mean()) - target) <= 1 / 60
    moe.inference_target, moe.inference_threshold = None, 0.0  # every probability passes: all experts
    with torch.no_grad():
        moe(x)
    assert moe.last_load.tolist() == [E] * 3


def test_learned_thresholds_track_the_training_capacity():
    """After training forwards on a batch, the EMA thresholds give about C experts per token on it in eval."""
    moe = make_moe("global_pool", capacity=1.0)
    for p in moe.predictor.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 32, D)
    moe.train()
    moe(x)
    k = 2 * 32 // E
    prob = moe.predictor(x.view(-1, D)).sigmoid()  # (B, N, D) -> (S, D) -> (S, E)
    torch.testing.assert_close(moe.threshold, prob.topk(k, 0).values[-1])  # first update: the k-th largest
    moe(torch.randn(2, 32, D))
    assert moe.threshold_updates == 2
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert 0.5 < float(moe.last_load.mean()) < 2.0


def test_gradients_reach_every_expert_that_received_tokens():
    for mode, kw in [("global_pool", {}), ("token_choice", {"top_k": 1}), ("expert_choice", {})]:
        moe = make_moe(mode, **kw).train()
        x = torch.randn(2, 6, D, requires_grad=True)
        (moe(x) ** 2).sum().backward()
        received = moe.last_mask.sum((0, 1))  # (E,)
        grad_norm = moe.experts.fc1_weight.grad.flatten(1).norm(dim=1)  # (E, H, D) -> (E, H*D) -> (E,)
        assert torch.equal(grad_norm > 0, received > 0), mode
        assert moe.gate_weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    # The predictor learns from its own loss only; its input is detached.
    moe = make_moe("global_pool").train()
    x = torch.randn(2, 6, D, requires_grad=True)
    moe(x)
    auxiliary_losses(moe)["moe_capacity_predictor"].backward()
    assert x.grad is None and moe.predictor[0].weight.grad.abs().sum() > 0


def test_dense_mode_equals_a_dit_block_with_the_same_weights():
    torch.manual_seed(0)
    dit = DiTBlock(D, 1, 4, num_heads=4)
    for p in dit.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe = Block(D, 1, 4, num_heads=4, moe_mode="dense")
    moe.load_state_dict(dit.state_dict())
    x, c = torch.randn(2, 10, D), torch.randn(2, D)
    assert torch.equal(moe(x, c, None), dit(x, c, None))
    # Under interleave the even blocks of any mode stay dense DiT blocks.
    even = Block(D, 0, 4, num_heads=4, moe_mode="global_pool")
    even.load_state_dict(dit.state_dict())
    assert not even.is_moe and torch.equal(even(x, c, None), dit(x, c, None))


def test_routing_over_moe_keeps_bypassing_tokens_bit_identical():
    torch.manual_seed(0)
    model = build_backbone("diffmoe", "tiny", input_size=8, in_channels=1, patch_size=2, num_classes=3,
                           depth=4, interleave=False, num_experts=E)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model.router = Router(RandomRouting(), [Route(0.5, 0, 3)])
    model.train()
    x, c = torch.randn(3, 16, 128), torch.randn(3, 128)
    out = model.router.run(model.blocks, x, c, model.grid, True)
    processed = model.router.last_masks[0]  # (B, N)
    assert torch.equal(out[~processed], x[~processed])
    assert not torch.allclose(out[processed], x[processed])
    for layer in moe_layers(model):  # the pool holds only the processed tokens: S = B * K
        assert layer.last_mask.shape[:2] == (3, 8)
        assert layer.last_mask.sum((0, 1)).tolist() == [3 * 8 // E] * E


def test_backbone_trains_a_step_with_aux_losses_and_reports_capacity():
    torch.manual_seed(0)
    model = build_backbone("diffmoe", "tiny", input_size=8, in_channels=1, patch_size=2, num_classes=3, depth=2)
    x, t, y = torch.randn(4, 1, 8, 8), torch.randn(4), torch.tensor([0, 1, 2, 0])
    model.train()
    out = model(x, t, y)
    aux = auxiliary_losses(model)
    assert set(aux) == {"moe_capacity_predictor"} and aux["moe_capacity_predictor"] > 0
    (out.square().mean() + sum(aux.values())).backward()
    model.eval()
    set_inference_capacity(model, target=1.5)
    with torch.no_grad():
        model(x, t, y)
    assert auxiliary_losses(model) == {}
    stats = capacity_stats(model)
    assert stats["per_sample"].shape == (4,) and abs(float(stats["mean"]) - 1.5) <= 1 / 64
    assert activated_parameters(model, "measured") > activated_parameters(model) - 1
    with pytest.raises(ConfigError, match="not both"):
        set_inference_capacity(model, threshold=0.5, target=1.0)
    with pytest.raises(ConfigError, match="moe_mode"):
        build_backbone("diffmoe", "tiny", input_size=8, in_channels=1, patch_size=2, num_classes=3, moe_mode="topk")


@pytest.mark.parametrize("preset, dense_m", [("S", 32.86), ("B", 130.30), ("L", 457.82)])
def test_activated_parameters_match_the_dense_dit(preset, dense_m):
    with torch.device("meta"):
        model = build_backbone("diffmoe", preset, input_size=32, in_channels=4, patch_size=2, num_classes=1000)
        dit = build_backbone("dit", preset, input_size=32, in_channels=4, patch_size=2, num_classes=1000)
    assert activated_parameters(model, router=False) == sum(p.numel() for p in dit.parameters())
    assert activated_parameters(model, router=False) / 1e6 == pytest.approx(dense_m, abs=0.01)
    assert len(moe_layers(model)) == model.depth // 2 and all(m.num_experts == 16 for m in moe_layers(model))


# Data parallel: the pool is per process, the thresholds are averaged over processes.


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        moe = make_moe("global_pool")
        for p in moe.predictor.parameters():
            torch.nn.init.normal_(p, std=0.3)
        moe.train()
        x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(100 + rank))  # different data per rank
        moe(x)
        torch.save({"mask": moe.last_mask, "threshold": moe.threshold.clone()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_keep_per_process_pools_and_average_thresholds(tmp_path):
    # Forked, not spawned: two real gloo processes without two more interpreters importing torch (seconds each).
    mp.start_processes(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    kth = []
    for rank, res in enumerate(results):
        # Replay this rank alone: the same choices, so no token of the other rank entered its pool.
        moe = make_moe("global_pool")
        for p in moe.predictor.parameters():
            torch.nn.init.normal_(p, std=0.3)
        moe.train().sync_thresholds = False
        moe(torch.randn(2, 12, D, generator=torch.Generator().manual_seed(100 + rank)))
        assert torch.equal(res["mask"], moe.last_mask)
        assert res["mask"].sum((0, 1)).tolist() == [2 * 12 // E] * E
        kth.append(moe.threshold)  # this rank's own first update: its k-th largest probability
    torch.testing.assert_close(results[0]["threshold"], results[1]["threshold"], rtol=0, atol=0)
    torch.testing.assert_close(results[0]["threshold"], (kth[0] + kth[1]) / 2)
    assert not torch.allclose(kth[0], kth[1])
