"""Choosing the one strategy an ``Accelerator`` trains with, from its arguments (and the
launch's environment for those it was not given), refusing two stacks at once.

Example::

    strategy = pick_strategy(state, "no", DistributedDataParallelKwargs(), fsdp_plugin=None)
    strategy.describe()      # "DDP" with two processes
"""

from __future__ import annotations

from typing import Any

from nblaunch.training.options.fsdp_plugin import sharding_settings
from nblaunch.training.options.kwargs import DistributedDataParallelKwargs
from nblaunch.training.runtime.state import DistributedType, PartialState
from nblaunch.training.strategy.interface import Strategy
from nblaunch.training.strategy.replicated import Replicated
from nblaunch.training.strategy.sharded import Sharded

__all__ = ["pick_strategy"]


def pick_strategy(state: PartialState, mixed_precision: str, ddp_options: DistributedDataParallelKwargs,
                    fsdp_plugin: Any = None) -> Strategy:
    """The strategy for these arguments; each stack's own checks run here, before any step."""
    on_xla = state.distributed_type is DistributedType.XLA
    if fsdp_plugin is not None:
        if on_xla:
            raise NotImplementedError("fsdp_plugin is not supported on XLA devices by nblaunch")
        return Sharded(sharding_settings(fsdp_plugin, mixed_precision), state)  # refuses before any step
    return Replicated(ddp_options, state.num_processes, on_xla)
