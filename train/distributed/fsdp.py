"""accelerate's FSDP2 as the distributed engine (trainer.distributed=fsdp): each block of the routed stack is an FSDP
unit, everything else (embeddings, output layers, SPRINT fusions) the root unit, so a process holds 1/N of every
parameter, gradient and AdamW state, and all-gathers one block's weights at a time.

- `fsdp_accelerator(**kwargs)`: an Accelerator with accelerate's FullyShardedDataParallelPlugin (FSDP2). On GPUs
  accelerate switches FSDP on from the plugin; for processes on CPUs (gloo, what CI runs) it would fall back to DDP,
  so there the same switch is made by hand: the rest is accelerate's own path (fully_shard, DTensor parameters,
  gradient clipping, reduces).
- `shard_blocks(accelerator, classes)`: the block classes that become units, set before `prepare`.
- `shard_projector(align, optimizer)`: the alignment projector as one more unit, joining AdamW after `prepare`.
- `sharded_copy(accelerator, net)`: a frozen copy of the model sharded as `prepare` shards it (the EMA teacher of
  align=self, which runs beside the model and cannot borrow its shards mid-step); `reshard` frees what a forward
  without backward left gathered.
- `full_tensors(state, keep)`: a state dict of sharded DTensors gathered tensor by tensor into full CPU tensors, kept
  on the main process only, so peak memory is one full tensor per process. A collective: every process calls it,
  with the same keys in the same order.
- `copy_into_shards(views, full)`: a full state dict (a checkpoint) copied into each process's shards; `views` are
  state-dict tensors that share storage with the parameters.
- `optimizer_by_name` / `optimizer_from_names`: AdamW's state keyed by parameter name, as torch's full optimizer
  state dicts are, or by position, as `optimizer.state_dict()` is; a checkpoint of either kind resumes either way.
"""

from __future__ import annotations

import copy

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from routing.errors import ConfigError


def fsdp_accelerator(**kwargs) -> Accelerator:
    """An Accelerator that shards the model it prepares with FSDP2 (one process gives a plain, unsharded one)."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, state_dict_type="FULL_STATE_DICT")
    accelerator = Accelerator(fsdp_plugin=plugin, **kwargs)
    state = accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU:
        # accelerate keeps FSDP to accelerators; fully_shard runs on CPU tensors over gloo as well.
        state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState records its own
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
    return accelerator


def shard_blocks(accelerator: Accelerator, classes: list[str]) -> None:
    """Make every module of these classes (the routed blocks) an FSDP unit of the model `prepare` is given next."""
    if not accelerator.is_fsdp2:
        raise ConfigError("trainer.distributed=fsdp shards the model over processes, but this run has one process; launch it "
                          "with `accelerate launch --multi_gpu --num_processes N -m train ...` (N >= 2).")
    accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = sorted(set(classes))


def shard_projector(align: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Shard the alignment projector over the processes (its own FSDP unit) and add it to AdamW as the second group,
    as the unsharded run has it. Done after accelerate's `prepare`, which shards one model and would refuse an
    optimizer parameter that is not that model's."""
    fully_shard(align)
    optimizer.add_param_group({"params": list(align.parameters())})


def sharded_copy(accelerator: Accelerator, net: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the unsharded `net` in eval mode, sharded by accelerate's own FSDP2 path with the plugin
    `prepare` uses: the same units over the same processes, so each parameter's local shard has the shape of the
    model's (`ShardedEma.copy_into` fills it). Costs one more 1/N of the weights per process."""
    twin = copy.deepcopy(net)
    fsdp2_prepare_model(accelerator, twin)  # with requires_grad as the model's: under mixed precision it upcasts those
    return twin.requires_grad_(False).eval()


def reshard(net: torch.nn.Module) -> None:
    """Shard again every unit a forward without backward left gathered (the root unit keeps its weights gathered for
    the backward that never comes; a forward stopped early by an exception leaves its unit gathered too)."""
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def trained_modules(net: torch.nn.Module, align: torch.nn.Module | None) -> torch.nn.Module:
    """One module whose parameter names are AdamW's names in a full optimizer state dict: the network's own, then the
    alignment projector's under `align.` (its second group); the network itself without alignment."""
    if align is None:
        return net
    if next(net.parameters(recurse=False), None) is not None:
        raise ValueError("the network holds parameters of its own; the joined names would miss them")
    joined = torch.nn.Module()
    for name, child in net.named_children():
        joined.add_module(name, child)
    joined.add_module("align", align)
    return joined


def is_sharded(tensors) -> bool:
    return any(isinstance(v, DTensor) for v in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (a view of the parameter's storage); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def full_tensors(state: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """Full CPU copies of `state`'s tensors where `keep` (the main process), {} elsewhere; a collective."""
    out = {}
    for name, value in state.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            out[name] = full.detach().to("cpu", copy=True)
    return out


@torch.no_grad()
def copy_into_shards(views: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into the local shards of `views`; RuntimeError naming the keys when the two differ."""
    if set(views) != set(full):
        missing, unexpected = sorted(set(views) - set(full)), sorted(set(full) - set(views))
        raise RuntimeError(f"Missing key(s) {missing[:3]}, unexpected key(s) {unexpected[:3]}")
    for name, view in views.items():
        source = full[name].to(device=view.device, dtype=view.dtype)
        if tuple(source.shape) != tuple(view.shape):
            raise RuntimeError(f"size mismatch for {name}: {tuple(source.shape)} in the checkpoint, {tuple(view.shape)} here")
        if isinstance(view, DTensor):
            # Every process holds the whole checkpoint: each takes its own chunk, no communication.
            source = distribute_tensor(source, view.device_mesh, view.placements, src_data_rank=None).to_local()
        local(view).copy_(source)


def shard_optimizer_state(state: dict, params: list[torch.Tensor]) -> dict:
    """A full, positional AdamW state with every per-parameter tensor (exp_avg, exp_avg_sq) cut to its parameter's
    shards, for `optimizer.load_state_dict` on a sharded model; every process holds the whole state."""
    out = {"state": {}, "param_groups": state["param_groups"]}
    for i, entry in state["state"].items():
        p = params[i]
        out["state"][i] = {
            k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            if isinstance(p, DTensor) and torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape) else v
            for k, v in entry.items()
        }
    return out


def optimizer_by_name(state: dict, names: list[str]) -> dict:
    """`optimizer.state_dict()` (parameters by position) -> keyed by parameter name (`names`, in the optimizer's order)."""
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def optimizer_from_names(state: dict, names: list[str]) -> dict:
    """The inverse of `optimizer_by_name`, for `optimizer.load_state_dict`."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}
