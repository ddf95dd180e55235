"""Representation alignment beside the diffusion loss: REPA (a frozen encoder's patch features) or
self-alignment (a later block of the model itself, SRA / LayerSync), on every family and every route.

- REPA (Yu et al. 2025): lambda * mean over tokens of -cos(projector(h_l(x_t)), the encoder's patch feature of the
  clean image at that token); the projector is three linear layers with SiLU (width 2048 in REPA), lambda 0.5.
- self, teacher=ema (SRA, Jiang et al. 2025): the teacher is the EMA model's block-T state at a lower noise level
  (flow time t - gap * u, u ~ U[0, 1), gap 0.2 in SRA), run without gradient and with every token; SRA's loss is a
  smooth L1 (beta 0.05) between head(h_l) and that state, its head Linear(D, 2D) - SiLU - Linear(2D, D), and its
  blocks 8 and 20 of 28 (4 and 8 of its small model's 12, 1-based), scaled to other depths by `sra_blocks`.
- self, teacher=online (LayerSync): block T of this same forward, detached (no gradient reaches the teacher).

`Alignment` holds the projector only, so it is saved with the run beside the model and never enters the model's
own weights, its EMA or an export. The hidden states come from `HiddenCapture` hooks (backbones/capture.py), so
the student is read from the forward the diffusion loss already runs. See docs/alignment.md for the trainer's calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backbones.capture import EnoughCaptured, HiddenCapture, check_layers
from backbones.ops.moe import capacity_routing
from routing.errors import ConfigError

MODES = ("repa", "self")
TEACHERS = ("ema", "online")
DEFAULT_LOSS = {"repa": "cosine", "self": "smooth_l1"}
DEFAULT_HEAD = {"repa": "repa", "self": "sra"}
EDM_SIGMA_MIN = 0.002  # EDM's smallest noise level: the teacher's sigma never reaches 0 (ln 0 in c_noise)


class Projector(nn.Sequential):
    """REPA's projector, Linear(D, W) - SiLU - Linear(W, W) - SiLU - Linear(W, C): hidden state -> target feature space."""

    def __init__(self, hidden_size: int, width: int, out_dim: int):
        super().__init__(nn.Linear(hidden_size, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, out_dim))


class SRAHead(nn.Sequential):
    """SRA's head, Linear(D, W) - SiLU - Linear(W, C), W = 2D in SRA: the student's state -> the teacher's."""

    def __init__(self, hidden_size: int, width: int, out_dim: int):
        super().__init__(nn.Linear(hidden_size, width), nn.SiLU(), nn.Linear(width, out_dim))


HEADS = {"repa": Projector, "sra": SRAHead}


def head_width(head: str, hidden_size: int, width: int | None) -> int:
    """The head's hidden width: `width`, or the head's own (REPA: 2048; SRA: twice the model's width)."""
    if width is not None:
        return width
    return 2 * hidden_size if head == "sra" else 2048


def sra_blocks(depth: int) -> tuple[int, int]:
    """SRA's student and teacher blocks (0-based) at `depth`: the line through SRA's two defaults, blocks 4 and 8 of
    12 (its small model) and 8 and 20 of 28 (SiT-XL), 1-based, i.e. student depth/4 + 1 and teacher 3 depth/4 - 1.
    Depth 8 (the tiny preset): blocks 2 and 4 (0-based); depth 12: 3 and 7; depth 28: 7 and 19."""
    if depth < 2:
        raise ConfigError(f"self-alignment aligns one block with a later one, but the model has {depth} block; use backbone.depth >= 2.")
    student = depth // 4  # 1-based depth/4 + 1
    teacher = min(max(3 * depth // 4 - 2, student + 1), depth - 1)  # 1-based 3 depth/4 - 1, after the student
    return student, teacher


def default_blocks(mode: str, layer: int | None, teacher_layer: int | None, depth: int) -> tuple[int, int | None]:
    """The config's blocks with a null one filled in: SRA's (`sra_blocks`) for self; REPA names its block itself."""
    if mode == "self" and (layer is None or teacher_layer is None):
        student, teacher = sra_blocks(depth)
        return student if layer is None else layer, teacher if teacher_layer is None else teacher_layer
    if layer is None:
        raise ConfigError("align.layer=null picks SRA's blocks, which only align=self has; set align.layer (REPA: block 8 of 28, align.layer=7).")
    return layer, teacher_layer


def gather_tokens(x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """x (B, N, C) at `positions` (B, K) -> (B, K, C); None: all of x."""
    if positions is None:
        return x
    return x.gather(1, positions[:, :, None].expand(-1, -1, x.shape[-1]))  # (B, K) -> (B, K, C)


def negative_cosine(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """REPA's loss: the mean over samples and tokens of -cos(pred, target); (B, K, C) each -> scalar."""
    return -(F.normalize(pred, dim=-1) * F.normalize(target, dim=-1)).sum(-1).mean()


def smooth_l1(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """SRA's default loss: smooth L1 with beta 0.05, averaged over every element."""
    return F.smooth_l1_loss(pred, target, beta=0.05)


LOSSES = {"cosine": negative_cosine, "smooth_l1": smooth_l1}


def teacher_time(objective: str, t: torch.Tensor, gap: float, u: torch.Tensor) -> torch.Tensor:
    """SRA's lower noise level for the EMA teacher: flow time t - gap * u, clamped to [0, 1]. EDM's sigma is the same
    path scaled (z / (1 - t) = x + sigma eps with sigma = t / (1 - t)), so sigma is mapped to t and back."""
    if objective == "flow":
        return (t - gap * u).clamp(0.0, 1.0)
    if objective == "edm":
        s = t / (1 + t)
        floor = s.clamp(max=EDM_SIGMA_MIN / (1 + EDM_SIGMA_MIN))  # never above the student's own noise level
        lower = torch.maximum(s - gap * u, floor)
        return lower / (1 - lower)
    raise ValueError(f"no teacher noise level for objective {objective!r}; self-alignment with the EMA teacher knows edm and flow.")


class Alignment(nn.Module):
    """The weighted alignment loss of one micro-batch; its only parameters are the projector's.

    backbone: the online Backbone (its blocks are hooked now); layer, teacher_layer: block indices, negative from
    the end (None for self: SRA's, `sra_blocks`); head: repa | sra (None: the mode's own, REPA's projector for repa and
    SRA's head for self); width: the head's hidden width (None: the head's own, `head_width`); target_dim: the
    encoder's feature width for REPA (the backbone's width for self); targets: for REPA, a callable clean images
    (B, C, H, W) -> (B, N, C) features on the backbone's token grid, in raster order.
    """

    def __init__(self, backbone: nn.Module, mode: str, layer: int | None, *, weight: float = 0.5, width: int | None = None,
                 target_dim: int | None = None, loss: str | None = None, teacher_layer: int | None = None,
                 teacher: str = "ema", teacher_gap: float = 0.2, targets: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 head: str | None = None):
        super().__init__()
        if mode not in MODES:
            raise ConfigError(f"align={mode} is unknown; choose align=none, align=repa or align=self.")
        if weight < 0:
            raise ConfigError(f"align.weight={weight} is below 0; lambda weighs a loss that is added, so use align.weight >= 0 (REPA: 0.5).")
        if mode == "repa" and (targets is None or target_dim is None):
            raise ValueError("REPA needs its target features: pass targets (the frozen encoder) and target_dim (its width).")
        if mode == "self" and teacher not in TEACHERS:
            raise ConfigError(f"align.teacher={teacher!r} is unknown; choose ema or online.")
        self.mode, self.weight, self.teacher, self.teacher_gap = mode, float(weight), teacher, float(teacher_gap)
        self.loss_name = loss or DEFAULT_LOSS[mode]
        self.loss_fn = LOSSES[self.loss_name]
        self.head = head or DEFAULT_HEAD[mode]
        if self.head not in HEADS:
            raise ConfigError(f"align.head={head!r} is unknown; choose repa (REPA's 3-layer projector) or sra (SRA's 2-layer head).")
        layer, teacher_layer = default_blocks(mode, layer, teacher_layer, backbone.depth)
        routes = backbone.router.routes
        self.layer, self.teacher_layer = check_layers(routes, backbone.depth, layer, teacher_layer if mode == "self" else None, teacher)
        out_dim = target_dim if mode == "repa" else backbone.hidden_size
        self.projector = HEADS[self.head](backbone.hidden_size, head_width(self.head, backbone.hidden_size, width), out_dim)
        online = [self.teacher_layer] if mode == "self" and teacher == "online" else []
        # Plain attributes, not submodules: neither the backbone nor the encoder belongs to this module's weights.
        self.__dict__["capture"] = HiddenCapture(backbone, [self.layer, *online])
        self.__dict__["targets"] = targets
        self.__dict__["_teacher_captures"] = {}
        # The EMA teacher's forward stops after its block by an exception; a network whose forward must run whole (an
        # FSDP-sharded copy, whose hooks would be left mid-forward) sets this False.
        self.teacher_stops_early = True

    @property
    def needs_ema(self) -> bool:
        """Whether the targets come from the EMA network (self-alignment with teacher=ema)."""
        return self.mode == "self" and self.teacher == "ema"

    def forward(self, y: torch.Tensor, labels: torch.Tensor | None = None, t: torch.Tensor | None = None,
                noise: torch.Tensor | None = None, *, objective=None, ema: nn.Module | None = None,
                u: torch.Tensor | None = None, clean: torch.Tensor | None = None) -> torch.Tensor:
        """lambda * loss for the online forward just run (inside objective.loss on the same y, labels, t, noise).

        y: clean batch (B, C, H, W); objective, ema: for the EMA teacher, the objective (its `loss` forms the teacher's
        noisy input, its `name` the lower noise level) and the EMA's network (objective-wrapped, `.model` the
        Backbone); u: (B,) uniforms in [0, 1) for the teacher's noise gap (from the step's seeded draws); clean: what
        REPA's targets read instead of y, when y is not pixels (cached images or features beside latents).
        """
        if self.layer not in self.capture.hidden:
            raise RuntimeError("no hidden state was captured: call the alignment after the network's forward on this batch.")
        student = self.capture.hidden[self.layer]
        positions = self.capture.positions[self.layer]
        pred = self.projector(student)  # (B, K, D) -> (B, K, C)
        target = self._target(y, labels, t, noise, positions, objective, ema, u, clean)
        self.capture.clear()
        return self.weight * self.loss_fn(pred.float(), target.float())

    def _target(self, y, labels, t, noise, positions, objective, ema, u, clean=None) -> torch.Tensor:
        """(B, K, C) targets at the student's tokens, without gradient."""
        if self.mode == "repa":
            with torch.no_grad():
                return gather_tokens(self.targets(y if clean is None else clean), positions)
        if self.teacher == "online":
            hidden, held = self.capture.hidden[self.teacher_layer].detach(), self.capture.positions[self.teacher_layer]
            if held is None:
                return gather_tokens(hidden, positions)
            # In the student's route both blocks hold that route's one selection (the same tensor): checked by identity,
            # which reads nothing on the host.
            if held is not positions:
                raise RuntimeError("the online teacher's block holds other tokens than the student's (check_layers refuses this layout).")
            return hidden
        if ema is None or objective is None or t is None or noise is None:
            raise ValueError("self-alignment with teacher=ema needs t, noise, objective and ema (the EMA's network).")
        return gather_tokens(self.ema_teacher(ema, objective, y, labels, t, noise, u), positions)

    @torch.no_grad()
    def ema_teacher(self, ema: nn.Module, objective, y, labels, t, noise, u=None) -> torch.Tensor:
        """(B, N, D) block-T state of the EMA network at the lower noise level, every token (routes forced to ratio 0:
        no TREAD route runs, a SPRINT route runs all tokens), MoE layers on their training path (`capacity_routing`);
        the forward stops after block T (`teacher_stops_early`)."""
        backbone = ema.model
        capture = self._teacher_captures.get(id(backbone))
        if capture is None:
            capture = self._teacher_captures[id(backbone)] = HiddenCapture(backbone, [self.teacher_layer])
        u = torch.rand(t.shape, device=t.device) if u is None else u.to(t.device)
        capture.stop_after = self.teacher_layer if self.teacher_stops_early else None
        capture.attach()
        try:
            # Every token, and the training path of every layer that has one (DiffMoE's capacity routing: its eval path's
            # dynamic capacity would read each expert's load to the host, and differs from what the student runs).
            with backbone.router.forced(0.0), capacity_routing(backbone):
                try:
                    objective.loss(ema, y, labels, teacher_time(objective.name, t, self.teacher_gap, u), noise)
                except EnoughCaptured:
                    pass
            hidden = capture.hidden[self.teacher_layer]
        finally:
            # Hooks off between teacher forwards: the EMA's own forwards (previews, FID) run whole and keep nothing.
            capture.detach()
            capture.clear()
        return hidden
