"""What every diffusers adapter shares: run a pretrained transformer's blocks through the shared Router.

A `RoutedTransformer` holds a diffusers model and replaces only its forward's block loop: it embeds the
inputs with the model's own modules, hands the image tokens to `Router.run` over a list of `Step`s (one per
diffusers block, in the order the model runs them), and finishes with the model's own output layers. The
weights, their names and the model's own `forward` are untouched, so `model.state_dict()`, LoRA keys and
`save_pretrained` stay diffusers'.

Only image tokens are routed. Everything else a block needs travels in a `Stream`, which the Router passes
to every step as its `c`: the timestep embedding, the text stream (updated by joint blocks, never routed),
family extras such as the rotary table, and the current route's `Selection`, recorded by a thin wrapper
around the router's policy so a step can look up the original positions of the tokens it is given.

Interface: `net(x, t, cond)` with x (B, C, H, W) latents, t (B,) flow time in [0, 1] (t = 1 is noise) and
cond the family's conditioning (a dict; for DiT the class labels) returns the model's velocity (B, C, H, W),
the call shape of `edm.FlowLoss`. `cond` may carry `force_keep`, a mask of tokens every route processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from routing import ConfigError, ForceKeep, Router, RoutingPolicy, Selection, build_policy, resolve_routes
from routing.policy import check_force_keep

Grid = tuple[int, ...]  # (h, w) image tokens; (t, h, w) video tokens (Wan)

# The diffusers release these adapters mirror: they re-run each model's forward around the block loop.
DIFFUSERS_TESTED = "0.42"


@dataclass
class Stream:
    """The Router's `c` for a diffusers stack: everything a block needs besides its image tokens."""

    temb: torch.Tensor | None  # timestep (+ pooled text / label) embedding, as the model computes it
    tokens: int  # image tokens N of the full sequence
    text: torch.Tensor | None = None  # the context stream (Flux, SD3): every joint block updates it, all of it
    extra: dict[str, Any] = field(default_factory=dict)  # family specifics: rotary table, masks, kwargs
    selection: Selection | None = None  # the current route's subset, set at each route start
    cache: dict[str, Any] = field(default_factory=dict)  # per-route values (a gathered rotary table)

    def positions(self, k: int) -> torch.Tensor | None:
        """(B, k) original positions of the k image tokens a block is given; None when it is given all N.

        A route that keeps all N tokens keeps them in order (indices are sorted), so None is exact there too.
        """
        if k == self.tokens:
            return None
        if self.selection is None or self.selection.indices.shape[1] != k:
            raise RuntimeError(f"a block received {k} of {self.tokens} image tokens outside a recorded route")
        return self.selection.indices

    def float(self) -> Stream:
        """fp32 copy-in-place for the block the Router runs in fp32 after a route (`fp32_after_route`).

        Cast in place and return self: the text stream a block updates must stay the one later blocks read.
        """
        def cast(v):
            return v.float() if torch.is_tensor(v) and v.is_floating_point() else v

        self.temb, self.text = cast(self.temb), cast(self.text)
        self.extra = {k: tuple(cast(u) for u in v) if isinstance(v, tuple) else cast(v) for k, v in self.extra.items()}
        self.cache.clear()
        return self


class _Recording(RoutingPolicy):
    """The router's policy, unchanged, that also writes each route's Selection into the stream."""

    def __init__(self, inner: RoutingPolicy, stream: Stream):
        self.inner, self.stream = inner, stream
        self.name, self.yields_grid = inner.name, inner.yields_grid

    def num_processed(self, grid, selection_ratio):
        return self.inner.num_processed(grid, selection_ratio)

    def check(self, grid, selection_ratio):
        self.inner.check(grid, selection_ratio)

    def select(self, x, grid, selection_ratio, generator, force_keep=None):
        extra = {} if force_keep is None else {"force_keep": force_keep}
        sel = self.inner.select(x, grid, selection_ratio, generator, **extra)
        self.stream.selection = sel
        self.stream.cache.clear()
        return sel


@contextmanager
def recording(router: Router, stream: Stream) -> Iterator[None]:
    saved = router.policy
    router.policy = _Recording(saved, stream)
    try:
        yield
    finally:
        router.policy = saved


class Step:
    """One entry of the stack the Router runs: `step(x, stream, grid) -> x` around one diffusers block.

    A plain callable, not a Module, so the block stays registered only where diffusers put it.
    """

    def __init__(self, block: nn.Module, call: Callable[[nn.Module, torch.Tensor, Stream], torch.Tensor], kind: str):
        self.block, self.call, self.kind = block, call, kind

    def __call__(self, x: torch.Tensor, stream: Stream, grid: Grid | None) -> torch.Tensor:
        return self.call(self.block, x, stream)

    def __repr__(self) -> str:
        return f"Step({self.kind}: {type(self.block).__name__})"


def run_block(model: nn.Module, block: nn.Module, *args):
    """block(*args), under the model's gradient checkpointing when it is enabled (enable_gradient_checkpointing)."""
    if torch.is_grad_enabled() and getattr(model, "gradient_checkpointing", False):
        return model._gradient_checkpointing_func(block, *args)
    return block(*args)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, C * p * p), raster order, channels-major inside a patch (Flux packing)."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p)  # (B, C, h, p, w, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)


def unpatchify(x: torch.Tensor, grid: Grid, p: int, channels_last: bool) -> torch.Tensor:
    """(B, h*w, p*p*C) -> (B, C, h*p, w*p).

    channels_last: the token's features are ordered (p, p, C) as DiT/SD3/PixArt's proj_out writes them;
    otherwise (C, p, p) as Flux packs them.
    """
    (h, w), b = grid, x.shape[0]
    if channels_last:
        x = x.reshape(b, h, w, p, p, -1).permute(0, 5, 1, 3, 2, 4)  # (B, h, w, p, q, C) -> (B, C, h, p, w, q)
    else:
        x = x.reshape(b, h, w, -1, p, p).permute(0, 3, 1, 4, 2, 5)  # (B, h, w, C, p, q) -> (B, C, h, p, w, q)
    return x.reshape(b, x.shape[1], h * p, w * p)


def token_mask(mask: torch.Tensor | ForceKeep, grid: tuple[int, ...], patch: int | tuple[int, ...]) -> torch.Tensor | ForceKeep:
    """A force-keep mask on the token grid, (B, N) bool (a ForceKeep, per token with its host copy, as it is).

    Accepts it per token, (B, N), or per latent pixel, (B, H, W) or (B, 1, H, W), and on a video grid
    (t, h, w) per latent voxel, (B, T, H, W) or (B, 1, T, H, W); a token is kept when any latent pixel of its
    patch is marked. `patch` is the patch side, or one side per grid axis. Its rows are checked against the batch where
    a route selects with it (check_force_keep).

    The mask must be bool, as every policy's `select` requires: a float or integer mask is refused, not converted,
    since a soft mask (weights in [0, 1], a loss weight passed by mistake) would mark every non-zero token as forced,
    and accepting exact 0/1 values only would make the same call pass or fail with the values in it.
    """
    tensor = mask.mask if isinstance(mask, ForceKeep) else mask
    if tensor.dtype != torch.bool:
        raise ConfigError(f"force_keep must be a bool mask, got {tensor.dtype}; convert it where it is made "
                          "(e.g. mask > 0.5), so that only the tokens you mean are forced.")
    patch = (patch,) * len(grid) if isinstance(patch, int) else tuple(patch)
    pixels = tuple(n * p for n, p in zip(grid, patch))
    n = math.prod(grid)
    if isinstance(mask, ForceKeep):  # per token (the trainer's masks) or per pixel: pooled on the device and host alike
        host = token_mask(torch.from_numpy(mask.host), grid, patch).numpy()
        return check_force_keep(ForceKeep(token_mask(mask.mask, grid, patch), host), n)
    if mask.ndim == len(grid) + 2 and mask.shape[1] == 1:
        mask = mask[:, 0]
    if mask.ndim == 2 and mask.shape[1] == n:
        return mask
    if mask.ndim == len(grid) + 1 and tuple(mask.shape[1:]) == pixels:
        split = [v for side, p in zip(grid, patch) for v in (side, p)]
        mask = mask.reshape(-1, *split)  # (B, H, W) -> (B, h, p, w, p), or (B, t, p, h, p, w, p) on video
        for axis in range(2 * len(grid), 0, -2):  # the patch axes, last first so the others keep their place
            mask = mask.any(axis)
        return mask.reshape(-1, n)  # (B, h, w) -> (B, N)
    raise ConfigError(
        f"force_keep has shape {tuple(mask.shape)}; give (batch, {n}) per token or (batch, {', '.join(map(str, pixels))}) "
        "per latent pixel."
    )


# Inputs of diffusers' IP-adapters: the model's own forward projects the image embeddings before the blocks, which
# the adapters' loop does not re-run.
IP_ADAPTER_KEYS = ("ip_adapter_image_embeds", "ip_hidden_states", "ip_adapter_masks")


def refuse_ip_adapter(kwargs: Mapping | None, name: str) -> None:
    """One sentence for IP-adapter inputs in `kwargs` (the family's attention kwargs, called `name`)."""
    given = sorted(k for k in (kwargs or {}) if k in IP_ADAPTER_KEYS)
    if given:
        raise ConfigError(f"IP-adapter inputs ({name}[{given[0]!r}]) are not supported by the TREAD adapters, routed or not; "
                          "drop them from the conditioning (or call the diffusers model itself, without routing).")


def split_cond(cond, kwargs: dict) -> tuple[dict, torch.Tensor | None]:
    """Merge a positional cond (a mapping) with keyword conditioning; pull out `force_keep`."""
    merged = {**(dict(cond) if isinstance(cond, Mapping) else {}), **kwargs}
    return merged, merged.pop("force_keep", None)


class RoutedTransformer(nn.Module):
    """A diffusers transformer whose image tokens run through the shared Router. Subclasses: one per family.

    `net.model` is the diffusers model (weights untouched); `net.router` the Router; `net.steps` the stack the
    router indexes (route layer indices count these, e.g. Flux: its double blocks, then its single blocks).
    """

    family: str
    model_class: str

    def __init__(self, model: nn.Module, router: Router | None = None):
        super().__init__()
        if type(model).__name__ != self.model_class:
            raise ConfigError(f"the {self.family} adapter wraps a {self.model_class}, got {type(model).__name__}.")
        self.model = model
        self.router = router if router is not None else Router()
        self.steps: list[Step] = self.build_steps()
        self.last_grid: Grid | None = None  # the token grid of the last forward, for route_masks
        self.held_keep: torch.Tensor | None = None  # force-keep mask of the forwards inside `keeping`

    @contextmanager
    def keeping(self, force_keep: torch.Tensor | None) -> Iterator[RoutedTransformer]:
        """Force-keep `force_keep` ((B, N) per token, or per latent pixel) in every forward within, for callers whose call
        shape net(x, t, labels) carries no mask: the trainer's per-batch masks from the data (name.mask.png)."""
        saved, self.held_keep = self.held_keep, force_keep
        try:
            yield self
        finally:
            self.held_keep = saved

    @property
    def depth(self) -> int:
        return len(self.steps)

    @property
    def patch(self) -> int:
        """Latent pixels per token side: the model's own patch size (Flux, which packs 2x2 itself, overrides it)."""
        return self.model.config.patch_size

    @property
    def latent_channels(self) -> int:
        """Channels of the latents x the model takes (Flux, which packs 2x2 itself, overrides it)."""
        return self.model.config.in_channels

    @property
    def pretrained(self) -> nn.Module:
        """The diffusers model (also reached as `net.model`; this name is shared with `PromptConditioned`)."""
        return self.model

    def route_masks(self) -> list[torch.Tensor]:
        """Processed-image-token masks of the last forward, one (B, h, w) bool per route, as our backbones give."""
        return [m.view(-1, *self.last_grid) for m in self.router.last_masks]  # (B, N) -> (B, h, w)

    # Family hooks.
    def build_steps(self) -> list[Step]:
        raise NotImplementedError

    def embed(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, Stream, Grid]:
        """Inputs -> (image tokens (B, N, D), stream, token grid), with the model's own modules."""
        raise NotImplementedError

    def head(self, tokens: torch.Tensor, stream: Stream, grid: Grid) -> torch.Tensor:
        """Image tokens (B, N, D) -> velocity (B, C, H, W), with the model's own output layers."""
        raise NotImplementedError

    def oracle(self, x: torch.Tensor, t: torch.Tensor, cond=None, **kwargs) -> torch.Tensor:
        """The same mapping through the diffusers model's own forward (`reference` calls it in the base's precision)."""
        raise NotImplementedError

    def reference(self, x: torch.Tensor, t: torch.Tensor, cond=None, **kwargs) -> torch.Tensor:
        """The same mapping through the diffusers model's own forward: the unrouted oracle."""
        with self.base_precision(x.device):
            return self.oracle(x, t, cond, **kwargs)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond=None, *, force_keep: torch.Tensor | None = None, **kwargs):
        """x (B, C, H, W), t (B,) or () in [0, 1]; cond: a dict of the family's inputs (or DiT's labels)."""
        with self.base_precision(x.device):
            return self._forward(x, t, cond, force_keep, kwargs)

    def base_precision(self, device: torch.device):
        """Autocast to the base's dtype where no autocast is on: a bf16 base trains under bf16 autocast (the trainer
        requires it), and previews, `train.sample` and API calls pass fp32 latents, which its layers cannot take."""
        dtype = next(self.model.parameters()).dtype
        if dtype == torch.float32 or torch.is_autocast_enabled(device.type):
            return nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    def _forward(self, x: torch.Tensor, t: torch.Tensor, cond, force_keep: torch.Tensor | None, kwargs: dict):
        cond, mask = self.conditioning(cond, kwargs)
        mask = force_keep if force_keep is not None else mask if mask is not None else self.held_keep
        t = t.reshape(-1).expand(x.shape[0])  # () or (B,) -> (B,)
        tokens, stream, grid = self.embed(x, t, cond)
        self.last_grid = grid
        keep = None if mask is None else token_mask(mask.to(tokens.device), grid, self.patch)
        with recording(self.router, stream):
            tokens = self.router.run(self.steps, tokens, stream, grid, self.training, force_keep=keep)
        return self.head(tokens, stream, grid)

    def conditioning(self, cond, kwargs: dict) -> tuple[dict, torch.Tensor | None]:
        return split_cond(cond, kwargs)

    def extra_repr(self) -> str:
        routes = ", ".join(f"r{r.start_layer_idx}->{r.end_layer_idx} x{r.selection_ratio}" for r in self.router.routes)
        return f"family={self.family}, depth={self.depth}, policy={self.router.policy.name}, routes=[{routes}]"


def make_router(depth: int, policy: str | RoutingPolicy | None, routes, **router_kwargs) -> Router:
    """A Router for a stack of `depth` steps from a policy name (or object) and route specs (dicts or Routes)."""
    if isinstance(policy, str) or policy is None:
        policy = build_policy(policy or ("random" if routes else "none"))
    return Router(policy, resolve_routes(list(routes or []), depth), **router_kwargs)
