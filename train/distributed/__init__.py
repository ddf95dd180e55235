"""Sharded training through accelerate's FSDP2 (trainer.distributed=fsdp): the plugin, the sharded EMA, and full
state dicts gathered from (and copied back into) sharded parameters. Imports nothing else from train."""

from train.distributed.ema import ShardedEma
from train.distributed.fsdp import (
    copy_into_shards,
    fsdp_accelerator,
    full_tensors,
    is_sharded,
    optimizer_by_name,
    optimizer_from_names,
    reshard,
    shard_blocks,
    shard_optimizer_state,
    shard_projector,
    sharded_copy,
    trained_modules,
)

__all__ = ["ShardedEma", "copy_into_shards", "fsdp_accelerator", "full_tensors", "is_sharded", "optimizer_by_name",
           "optimizer_from_names", "reshard", "shard_blocks", "shard_optimizer_state", "shard_projector",
           "sharded_copy", "trained_modules"]
