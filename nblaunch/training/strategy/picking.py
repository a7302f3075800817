"""Choosing the one strategy an ``Accelerator`` trains with, from its arguments (and the
launch's environment for those it was not given), refusing two stacks at once.

Example::

    strategy = pick_strategy(state, "no", DistributedDataParallelKwargs(), fsdp_plugin=None)
    strategy.describe()      # "DDP" with two processes
"""

from __future__ import annotations

from typing import Any

from nblaunch.training.options.deepspeed_plugin import adopt_deepspeed_plugin
from nblaunch.training.options.fsdp_plugin import sharding_settings
from nblaunch.training.options.parallelism import adopt_parallelism_config
from nblaunch.training.options.kwargs import DistributedDataParallelKwargs
from nblaunch.training.runtime.state import DistributedType, PartialState
from nblaunch.training.strategy.strategy_interface import Strategy
from nblaunch.training.strategy.replicated import Replicated
from nblaunch.training.strategy.sharded import Sharded

__all__ = ["pick_strategy"]


def pick_strategy(state: PartialState, mixed_precision: str, ddp_options: DistributedDataParallelKwargs,
                  fsdp_plugin: Any = None, deepspeed_plugin: Any = None, split_batches: bool = False,
                  parallelism_config: Any = None) -> Strategy:
    """The strategy for these arguments; each stack's own checks run here, before any step."""
    on_xla = state.distributed_type is DistributedType.XLA
    layout = adopt_parallelism_config(parallelism_config) if parallelism_config is not None else None
    tensor_parallel = layout is not None and layout.tp_enabled
    # FSDP2 between tensor-parallel groups is one stack (2-D), with dp_shard_size.
    two_d = tensor_parallel and fsdp_plugin is not None and layout.dp_shard_enabled
    asked = [name for name, plugin in (("fsdp_plugin", None if two_d else fsdp_plugin),
                                       ("deepspeed_plugin", deepspeed_plugin),
                                       ("parallelism_config(tp_size > 1)", layout if tensor_parallel else None))
             if plugin is not None]
    if len(asked) > 1:
        raise ValueError(f"Accelerator got {' and '.join(asked)}: one stack spreads a model; keep one "
                         "(FSDP2 and ZeRO-3 both shard parameters, gradients and optimizer state)")
    if tensor_parallel:
        if on_xla:
            raise NotImplementedError("tensor parallelism is not supported on XLA devices by nblaunch")
        # deferred: torch's tensor parallel modules load only for tensor parallelism
        from nblaunch.training.strategy.tensor_parallel import TensorParallel
        sharding = sharding_settings(fsdp_plugin, mixed_precision) if two_d else None
        return TensorParallel(layout, state, sharding)
    if layout is not None and layout.total_size > 1:  # data parallel sizes only: DDP, or FSDP2 for dp_shard
        layout.check_world(state.num_processes)
        if layout.dp_shard_enabled and fsdp_plugin is None:
            raise ValueError(f"ParallelismConfig(dp_shard_size={layout.dp_shard_size}) shards with FSDP2: give an "
                             "fsdp_plugin too, or dp_replicate_size for whole copies (DDP)")
        if layout.dp_shard_enabled and layout.dp_replicate_enabled:
            raise NotImplementedError("dp_shard_size and dp_replicate_size together (hybrid sharding) are not "
                                      "supported by nblaunch: give one of them")
    if deepspeed_plugin is not None:
        if on_xla:
            raise NotImplementedError("deepspeed_plugin is not supported on XLA devices")
        # deferred: the DeepSpeed strategy's module is loaded only for DeepSpeed (it needs the extra)
        from nblaunch.training.strategy.deepspeed_engine import DeepSpeedStrategy
        return DeepSpeedStrategy(adopt_deepspeed_plugin(deepspeed_plugin), state, mixed_precision, split_batches)
    if fsdp_plugin is not None:
        if on_xla:
            raise NotImplementedError("fsdp_plugin is not supported on XLA devices by nblaunch")
        return Sharded(sharding_settings(fsdp_plugin, mixed_precision), state)  # refuses before any step
    return Replicated(ddp_options, state.num_processes, on_xla)
