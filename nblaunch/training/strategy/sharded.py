"""``Sharded``: FSDP2 (``fully_shard``) as an ``fsdp_plugin`` asks; each rank holds a shard of
every parameter, gradient and optimizer state. One process shards too, as Accelerate does on one
GPU (CPU offload, the same checkpoints). The checkpoint part is the base's: sharded models are
written sharded.

Example::

    strategy = Sharded(sharding_settings(FullyShardedDataParallelPlugin(), "no"), state)
    model = strategy.wrap_model(model, torch.device("cpu"), trainable=True)
"""

from __future__ import annotations

import torch

from nblaunch.training.model.fsdp import shard_model
from nblaunch.training.options.fsdp_plugin import ShardingSettings
from nblaunch.training.runtime.state import DistributedType, PartialState
from nblaunch.training.strategy.strategy_interface import Strategy

__all__ = ["Sharded"]


class Sharded(Strategy):
    """FSDP2 over every rank (Accelerate's ``DistributedType.FSDP``, always FSDP2 here)."""

    distributed_type = DistributedType.FSDP

    def __init__(self, settings: ShardingSettings, state: PartialState) -> None:
        self.settings = settings
        self.state = state

    def places(self, trainable: bool) -> bool:
        return not trainable  # sharding moves one unit at a time, or offloads

    def autocasts(self, trainable: bool) -> bool:
        # A sharded model computes in its policy's dtype, without autocast, as under Accelerate's
        # FSDP2 (autocast would run its LayerNorms and softmaxes in fp32 and train differently).
        return not trainable

    def wrap_model(self, model: torch.nn.Module, device: torch.device, trainable: bool) -> torch.nn.Module:
        if not trainable:
            return model
        self.state.ensure_process_group()
        return shard_model(model, self.settings, device)

    def describe(self) -> str:
        return "FSDP2"
