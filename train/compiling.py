"""`trainer.compile` and `trainer.cuda_graphs`: how the trained denoiser runs.

- off: eager.
- blocks: every block compiled in place; the router, embedders and preconditioning stay eager, so a step calls
  a few graphs per block.
- model: the whole denoiser in one graph: preconditioning, embedders, each route's gather and scatter, SPRINT's
  fusion and the blocks. Route draws are made before the forward (`Router.set_draws`) and enter the graph as an
  input, and route subset sizes are static for a config, so nothing recompiles from step to step.
- compile_regions (with model): every block is a nested compile region (torch.compiler.nested_compile_region), so
  the whole-model graph compiles each distinct block once (per token count, autocast state, per-layer constant)
  and calls that code for the others, so compile time follows the distinct blocks rather than the depth. Inductor
  cannot fuse across a region's border (one block's last add with the next one's norm). DiffMoE and fine-tuned
  models are refused (_NO_REGIONS).
- cuda_graphs (with model, on CUDA): the compiled forward and backward are captured as CUDA graphs (inductor's
  cudagraph trees) and replayed, which removes the launch overhead of small kernels (SPRINT's sparse middle, small
  models). Inputs that are not weights (the batch, the route draws) are copied into the graphs' static buffers
  on every replay, so routes stay fresh each step and a resumed run draws what the first run drew.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from routing import ConfigError

MODES = ("off", "blocks", "model")


def compile_mode(value) -> str:
    """trainer.compile as one of MODES; configs written before the modes existed said true (blocks) or false."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "blocks"
    if value not in MODES:
        raise ConfigError(f"trainer.compile={value!r} is unknown; choose off, blocks (each block compiled) or model (the whole denoiser).")
    return value


def compile_blocks(model: nn.Module) -> None:
    """torch.compile every block in place (`trainer.compile=blocks`), so state-dict keys stay unchanged.

    Blocks of one family share their code and dynamo treats their parameters as inputs, so the whole stack
    reuses a few graphs: one per token count (the full sequence and each route's subset, static for a config,
    hence dynamic=False), per autocast state (the fp32 block after a route) and per Python constant that
    differs between layers (Mamba's scan order). The recompile limit is raised to fit them all.
    """
    limit = 4 * len(model.blocks)
    _raise_recompile_limits(limit)
    for block in model.blocks:
        block.compile(dynamic=False)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (reported after the first compiled steps)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_network(net: nn.Module, backbone: nn.Module, mode, cuda_graphs: bool = False, *, regions: bool = False,
                    log: Callable[[str], None] = print, backend: str = "inductor") -> Callable:
    """What the trainer calls in place of `net` (the objective's wrapper around `backbone`), as trainer.compile says.

    off and blocks return `net` itself (blocks compiles `backbone`'s blocks in place). model returns a callable with
    net's signature that runs the compiled whole network; `net` is unchanged, so its state dict, the EMA copy and
    eval-mode sampling keep using the eager module. Call `backbone.router.set_draws` before each training forward:
    without it the routes draw from a torch.Generator inside the forward, which splits the graph at every route.
    cuda_graphs that cannot be used print one line saying why, and the step runs without them. `regions`
    (trainer.compile_regions) makes each block of `backbone`'s router a nested compile region.
    """
    mode = compile_mode(mode)
    if regions:
        _use_regions(backbone, mode)
    if cuda_graphs:
        reason = _no_cuda_graphs(net, mode, backend)
        if reason:
            log(f"trainer.cuda_graphs: not used: {reason}; the step runs without CUDA graphs.")
            cuda_graphs = False
    if mode == "off":
        return net
    if mode == "blocks":
        compile_blocks(backbone)
        return net
    # Bucketed data gives a few input shapes, one graph each (dynamic=False keeps every graph's shapes static).
    _raise_recompile_limits(16)
    router = getattr(backbone, "router", None)
    if router is not None and router.routes and router.tokens is None:
        log("trainer.compile=model: this network's router does not know its token count, so route draws happen inside the "
            "forward and split the compiled graph at every route.")
    compiled = torch.compile(net, dynamic=False, backend=backend, mode="reduce-overhead" if cuda_graphs else None)
    return CompiledNetwork(net, compiled, cuda_graphs, log)


class CompiledNetwork:
    """The compiled whole network; with CUDA graphs, also marks each call as a new step for cudagraph trees and says,
    once, why a call runs uncaptured (the first call of a shape compiles and warms up; inductor's own skips)."""

    def __init__(self, net: nn.Module, compiled: Callable, cuda_graphs: bool, log: Callable[[str], None]):
        self.module, self.compiled, self.cuda_graphs, self.log = net, compiled, cuda_graphs, log
        self.shapes: set[tuple] = set()
        self.skips_seen = 0
        self.grads: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> one flat buffer holding every .grad

    def __call__(self, *args, **kwargs):
        if not self.cuda_graphs:
            return self.compiled(*args, **kwargs)
        shape = tuple(tuple(a.shape) for a in args if torch.is_tensor(a))
        if shape not in self.shapes:
            first = not self.shapes
            self.shapes.add(shape)
            self.log("trainer.cuda_graphs: the first step runs uncaptured (it compiles, then warms up the graphs); later steps replay them."
                     if first else f"trainer.cuda_graphs: inputs of a new shape {shape} run uncaptured while their graph is compiled and recorded.")
        if torch.is_grad_enabled():
            self._stable_grads()
        # One training forward and backward per call: cudagraph trees may reuse the previous step's memory from here on.
        torch.compiler.cudagraph_mark_step_begin()
        out = self.compiled(*args, **kwargs)
        self._report_skips()
        return out

    def _stable_grads(self) -> None:
        """Give every trained parameter without a .grad a zeroed one outside the graphs' memory pool.

        A captured backward's gradients live in the pool, and autograd keeps the first one of a step as .grad itself;
        the next micro-batch's replay would overwrite it (gradient accumulation), which cudagraph trees refuse. With
        .grad already allocated here, autograd adds into it instead. The buffers are views of one flat tensor per
        dtype, zeroed by one kernel when a step starts (the trainer's zero_grad(set_to_none=True) left them None).
        """
        params = [p for p in self.module.parameters() if p.requires_grad]
        missing = [p for p in params if p.grad is None]
        if not missing:
            return
        groups: dict[tuple, list[nn.Parameter]] = {}
        for p in params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        for key, group in groups.items():
            flat = self.grads.get(key)
            if flat is None or flat.numel() != sum(p.numel() for p in group):
                flat = self.grads[key] = torch.empty(sum(p.numel() for p in group), dtype=key[0], device=key[1])
            fresh = all(p.grad is None for p in group)
            if fresh:
                flat.zero_()
            offset = 0
            for p in group:
                view = flat[offset : offset + p.numel()].view_as(p)  # (numel,) -> p's shape; each parameter its own slice
                offset += p.numel()
                if p.grad is None:
                    p.grad = view if fresh else view.zero_()

    def __getattr__(self, name):
        # Everything else is the eager module's (parameters(), sigma_data, train()): a drop-in for `net`.
        return getattr(self.module, name)

    def _report_skips(self) -> None:
        from torch._dynamo.utils import counters

        skips = int(counters["inductor"]["cudagraph_skips"])
        if skips > self.skips_seen:
            self.skips_seen = skips
            self.log(f"trainer.cuda_graphs: inductor left {skips} graph(s) uncaptured (e.g. a CPU tensor or a data-dependent op inside); "
                     "run with TORCH_LOGS=cudagraphs to see which and why.")


def _no_cuda_graphs(net: nn.Module, mode: str, backend: str) -> str | None:
    """Why CUDA graphs cannot capture this network's step, or None."""
    if mode != "model":
        return f"they capture the whole compiled network, and trainer.compile={mode}; set trainer.compile=model"
    if backend != "inductor":
        return f"the compile backend is {backend}, and only inductor captures CUDA graphs"
    device = next((p.device for p in net.parameters()), torch.device("cpu"))
    if device.type != "cuda":
        return f"the model runs on the {device.type.upper()}, and CUDA graphs need a CUDA device"
    return None


# The networks whose blocks cannot be regions, and why.
_NO_REGIONS = {
    "diffmoe": "DiffMoE's blocks record their aux losses and loads as they run, which a nested compile region cannot hold",
    "fine-tuned": "it applies to the blocks of the backbones trained from scratch (dit, rwkv, mamba), not to a fine-tuned "
                  "model's steps",
    "no router": "it applies to the blocks a router runs, and this network has no router",
}


def _use_regions(backbone: nn.Module, mode: str) -> None:
    """trainer.compile_regions: refused where it cannot apply, else set on the backbone's router."""
    blocks = getattr(backbone, "blocks", None)
    kind = ("no router" if getattr(backbone, "router", None) is None else "fine-tuned" if blocks is None
            else "diffmoe" if any(getattr(block, "records_in_forward", False) for block in blocks) else None)
    check_regions(mode, kind)
    backbone.router.regions = True


def check_regions(mode: str, kind: str | None = None) -> None:
    """trainer.compile_regions=true needs the whole-model compile, a torch with nested compile regions, and blocks that
    can be regions (`kind`: a key of _NO_REGIONS, or None)."""
    if kind is not None:
        raise ConfigError(f"trainer.compile_regions=true cannot be used here: {_NO_REGIONS[kind]}; set trainer.compile_regions=false.")
    if mode != "model":
        raise ConfigError(f"trainer.compile_regions=true needs trainer.compile=model (it is {mode}); set trainer.compile=model "
                          "or trainer.compile_regions=false.")
    if not hasattr(torch.compiler, "nested_compile_region"):
        raise ConfigError(f"trainer.compile_regions=true needs torch >= 2.8 (torch.compiler.nested_compile_region); this is "
                          f"torch {torch.__version__}: upgrade torch or set trainer.compile_regions=false.")


def tf32_matmuls(device) -> None:
    """fp32 matmuls and convolutions on tensor cores (TF32) on CUDA, as the trainer and the official DiT's trainer run
    them: the fp32 block after a route (routing.fp32_after_route) would otherwise run several times slower."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


def _raise_recompile_limits(limit: int) -> None:
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 8 * limit)
