"""Mixture-of-experts MLP for DiT blocks: token choice, expert choice per sample, and DiffMoE's global pool.

Every mode shares one gate, scores = softmax over experts of x W_g (no bias, W_g ~ N(0, 0.006)), and E
experts that are each a full DiT MLP (D -> H -> D, GELU-tanh), as in DiffMoE's release. A token's output is
the sum, over the experts that took it, of its gate score times that expert's output. A token no expert
took gets exactly 0 here, so the block's residual carries it unchanged.

- token_choice (Switch / GShard): each token takes its top_k experts; load-balancing loss
  E * sum_e f_e P_e (f_e: fraction of the token slots sent to e, P_e: mean gate score of e).
- expert_choice (EC-DiT): inside each sample, expert e takes its top k = floor(N / E * C) tokens.
- global_pool (DiffMoE): the pool is every token the layer sees in this process, S = B * N (under a TREAD
  route, B * K processed tokens); expert e takes its top k = floor(S / E * C) tokens of the pool. A capacity
  predictor (on the detached input) learns which experts took each token; its per-expert threshold is an
  EMA of the k-th largest predicted probability, averaged across processes. In eval mode expert e takes
  the top n_e tokens by gate score, n_e = #tokens whose predicted probability reaches the threshold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

MODES = ("token_choice", "expert_choice", "global_pool")


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # DiT's MLP activation


class Experts(nn.Module):
    """E MLPs with stacked weights, so that fixed-capacity modes run all experts as one batched matmul."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.fc1_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.fc2_bias = nn.Parameter(torch.zeros(num_experts, dim))
        # Per expert, as DiT initialises its MLP; xavier on the 3-D tensor would count E into the fans.
        for e in range(num_experts):
            nn.init.xavier_uniform_(self.fc1_weight[e])
            nn.init.xavier_uniform_(self.fc2_weight[e])

    def params_per_expert(self) -> int:
        return 2 * self.dim * self.hidden + self.hidden + self.dim

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """x (E, k, D): row e goes through expert e -> (E, k, D)."""
        h = _gelu(torch.baddbmm(self.fc1_bias[:, None], x, self.fc1_weight.transpose(1, 2)))  # (E, k, H)
        return torch.baddbmm(self.fc2_bias[:, None], h, self.fc2_weight.transpose(1, 2))

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x (n, D) through expert e -> (n, D); n may be 0."""
        return F.linear(_gelu(F.linear(x, self.fc1_weight[e], self.fc1_bias[e])), self.fc2_weight[e], self.fc2_bias[e])


class MoE(nn.Module):
    """Drop-in for a DiT MLP: (B, N, D) -> (B, N, D). Records its aux losses and load at every forward."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        mode: str,
        *,
        capacity: float = 1.0,
        top_k: int = 1,
        shared_experts: int = 0,
        threshold_decay: float = 0.95,
        sync_thresholds: bool = True,
        aux_weights: dict[str, float] | None = None,
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"MoE mode '{mode}' is unknown; choose one of {MODES}.")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}.")
        self.mode, self.num_experts, self.capacity, self.top_k = mode, num_experts, capacity, top_k
        self.gate_weight = nn.Parameter(torch.empty(num_experts, dim))  # W_g, no bias
        nn.init.normal_(self.gate_weight, std=0.006)
        self.experts = Experts(num_experts, dim, hidden)
        # Shared experts are always on: one MLP as wide as `shared_experts` experts together.
        self.shared = None
        if shared_experts:
            self.shared = Mlp(dim, shared_experts * hidden, act_layer=lambda: nn.GELU(approximate="tanh"))
            for layer in (self.shared.fc1, self.shared.fc2):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)
        self.predictor = None
        if mode == "global_pool":
            self.predictor = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, num_experts))
            for layer in (self.predictor[0], self.predictor[2]):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)
        self.threshold_decay, self.sync_thresholds = threshold_decay, sync_thresholds
        self.register_buffer("threshold", torch.zeros(num_experts))  # per-expert, on sigmoid(predictor)
        self.register_buffer("threshold_updates", torch.zeros((), dtype=torch.long))
        self.aux_weights = {"balance": 0.01, "capacity_predictor": 1.0, **(aux_weights or {})}
        # Inference controls (global_pool, eval mode); not state: a sampler sets them per run.
        self.inference_threshold: float | None = None
        self.inference_target: float | None = None
        # Capacity routing in eval mode (capacity_routing, below): the EMA teacher of self-alignment runs the training path.
        self.capacity_routing = False
        # Records of the last forward, for the trainer (aux losses) and for compute plots (load).
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.last_mask: torch.Tensor | None = None  # (B, N, E) bool: which experts took each token
        self.last_load: torch.Tensor | None = None  # (B,) activated experts per token, per sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        tokens = x.reshape(b * n, d)  # (B, N, D) -> (S, D)
        # Routing decisions in fp32: bf16 scores tie often and make top-k arbitrary.
        scores = F.linear(tokens.float(), self.gate_weight.float()).softmax(dim=-1)  # (S, E)
        self.aux_losses = {}
        if self.mode == "token_choice":
            out, mask = self._token_choice(tokens, scores)
        elif self.mode == "expert_choice":
            out, mask = self._expert_choice(tokens, scores, b, n)
        elif self.training or self.capacity_routing:
            out, mask = self._global_pool_train(tokens, scores)
        else:
            out, mask = self._global_pool_eval(tokens, scores)
        if self.shared is not None:
            out = out + self.shared(tokens)
        self.last_mask = mask.view(b, n, -1)  # (S, E) -> (B, N, E)
        self.last_load = self.last_mask.sum(-1).float().mean(-1)  # (B,)
        return out.view(b, n, d)  # (S, D) -> (B, N, D)

    # Dispatch and combine.

    def _combine_fixed(self, tokens: torch.Tensor, index: torch.Tensor, gating: torch.Tensor) -> torch.Tensor:
        """Every expert takes k tokens: index, gating (E, k) -> (S, D), untaken rows exactly 0."""
        e, k = index.shape
        y = self.experts.batched(tokens[index])  # (E, k, D)
        y = y * gating[..., None].to(y.dtype)
        out = tokens.new_zeros(tokens.shape[0], tokens.shape[1], dtype=y.dtype)
        # (E, k) -> (E*k,) and (E, k, D) -> (E*k, D): a token taken by several experts sums their outputs.
        return out.index_add(0, index.reshape(e * k), y.reshape(e * k, -1))

    def _combine_ragged(self, tokens: torch.Tensor, indices: list[torch.Tensor], gatings: list[torch.Tensor]):
        """Expert e takes indices[e] (any length) with weights gatings[e] -> (S, D), untaken rows exactly 0."""
        out = None
        for e, (index, gating) in enumerate(zip(indices, gatings)):
            # In training every expert runs, even on no tokens, so all parameters stay in the graph (DDP).
            if len(index) == 0 and not self.training:
                continue
            y = self.experts.one(e, tokens[index])  # (n_e, D)
            y = y * gating[:, None].to(y.dtype)
            out = tokens.new_zeros(tokens.shape, dtype=y.dtype) if out is None else out
            out = out.index_add(0, index, y)
        return tokens.new_zeros(tokens.shape) if out is None else out

    # Modes.

    def _token_choice(self, tokens, scores):
        s, e = scores.shape
        gating, expert_index = scores.topk(self.top_k, dim=-1)  # (S, k)
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, expert_index, True)  # (S, E)
        indices = [mask[:, i].nonzero().squeeze(1) for i in range(e)]
        out = self._combine_ragged(tokens, indices, [scores[index, i] for i, index in enumerate(indices)])
        if self.training:
            # Switch / GShard balance: E * sum_e f_e P_e, equal to 1 when load and scores are uniform.
            f = mask.float().sum(0) / (s * self.top_k)  # (E,) fraction of the token slots
            self.aux_losses["balance"] = e * (f * scores.mean(0)).sum()
        return out, mask

    def _expert_choice(self, tokens, scores, b, n):
        e = self.num_experts
        k = self._capacity_k(n)
        gating, index = scores.view(b, n, e).transpose(1, 2).topk(k, dim=-1)  # (S, E) -> (B, N, E) -> (B, E, k)
        index = index + torch.arange(b, device=index.device)[:, None, None] * n  # sample-local -> pool index
        index = index.transpose(0, 1).reshape(e, b * k)  # (B, E, k) -> (E, B*k)
        gating = gating.transpose(0, 1).reshape(e, b * k)  # (B, E, k) -> (E, B*k)
        return self._combine_fixed(tokens, index, gating), self._mask_from(index, scores)

    def _global_pool_train(self, tokens, scores):
        s = tokens.shape[0]
        k = self._capacity_k(s)
        gating, index = scores.t().topk(k, dim=-1)  # (E, S) -> (E, k)
        mask = self._mask_from(index, scores)
        if self.training:  # not for a teacher under capacity_routing: its predictor and thresholds stay as they are
            logits = self.predictor(tokens.detach()).float()  # (S, E); detached: it must not steer the features
            self.aux_losses["capacity_predictor"] = F.binary_cross_entropy_with_logits(logits, mask.float())
            self._update_threshold(logits.detach().sigmoid(), k)
        return self._combine_fixed(tokens, index, gating), mask

    def _global_pool_eval(self, tokens, scores):
        s, e = scores.shape
        prob = self.predictor(tokens).float().sigmoid()  # (S, E)
        n_e = (prob >= self.inference_thresholds(prob)).sum(0).tolist()  # (E,) dynamic capacity
        picks = [scores[:, i].topk(n_e[i]) for i in range(e)]  # top n_e tokens by gate score
        out = self._combine_ragged(tokens, [p.indices for p in picks], [p.values for p in picks])
        mask = torch.zeros_like(scores, dtype=torch.bool)
        for i, p in enumerate(picks):
            mask[p.indices, i] = True
        return out, mask

    # Capacity.

    def _capacity_k(self, pool: int) -> int:
        """k = floor(pool / E * C), at least 1 (a routed subset can be small) and at most the pool."""
        return min(pool, max(1, int(pool / self.num_experts * self.capacity + 1e-9)))

    def _mask_from(self, index: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """(E, k) pool indices -> (S, E) bool mask of which experts took each token."""
        mask = torch.zeros_like(scores, dtype=torch.bool).t()  # (E, S)
        return mask.scatter_(1, index, True).t()

    @torch.no_grad()
    def _update_threshold(self, prob: torch.Tensor, k: int) -> None:
        """EMA (decay 0.95) of each expert's k-th largest predicted probability, averaged over processes."""
        # A gradient-checkpointing recompute runs inside the backward pass: the forward counted this batch already.
        # (A compiled forward is traced once and never re-runs this Python, and dynamo cannot ask autograd.)
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        kth = prob.topk(k, dim=0).values[-1]  # (E,)
        # Start at the first observation rather than at 0 (which would mean "all experts"); chosen on the device,
        # so the step reads nothing back to the host and a compiled forward stays one graph.
        ema = self.threshold_decay * self.threshold + (1 - self.threshold_decay) * kth
        new = torch.where(self.threshold_updates == 0, kth, ema)
        if self.sync_thresholds and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The pool is per process, the threshold global: every process applies the mean update.
            dist.all_reduce(new, op=dist.ReduceOp.SUM)
            new /= dist.get_world_size()
        self.threshold.copy_(new)
        self.threshold_updates += 1

    def inference_thresholds(self, prob: torch.Tensor) -> torch.Tensor:
        """Per-expert thresholds on sigmoid(predictor) for this batch: target, override or learned."""
        s, e = prob.shape
        if self.inference_target is not None:
            # One threshold for all experts, the m-th largest probability: exactly m (token, expert) pairs pass.
            m = min(s * e, max(0, round(self.inference_target * s)))
            if m == 0:
                return prob.new_full((e,), float("inf"))
            return prob.flatten().topk(m).values[-1].expand(e)
        if self.inference_threshold is not None:
            return prob.new_full((e,), float(self.inference_threshold))
        return self.threshold.float()


@contextmanager
def capacity_routing(model: nn.Module) -> Iterator[None]:
    """Within: every MoE layer of `model` routes as in training though in eval mode (DiffMoE's global pool: each expert
    takes its top k = pool / E x C tokens), without the capacity predictor's loss or a threshold update. The EMA teacher
    of self-alignment runs so inside a training step: the same computation as the model it teaches, and no host read
    (the eval path's dynamic capacity reads each expert's token count)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.capacity_routing = True
    try:
        yield
    finally:
        for layer in layers:
            layer.capacity_routing = False
