"""Ranks with different numbers of batches: ``join_uneven_inputs`` and
``trigger_sync_in_backward`` (Accelerate's names and meaning)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel

from nblaunch.training.model.gradient_sync import forced_gradient_sync
from nblaunch.training.sharding import IterableDatasetShard, ShardedBatchSampler


@contextlib.contextmanager
def join_uneven_inputs(joinables: list[Any], loaders: list[Any], distributed: bool, single_process: bool,
                       default_even_batches: bool, even_batches: bool | None = None) -> Iterator[None]:
    """torch's ``Join`` over ``joinables`` (DDP models, ZeroRedundancyOptimizer): a rank that
    runs out of batches keeps answering the others' collectives instead of leaving them hanging.
    As in Accelerate, Join is on only where batches are uneven (``even_batches=False``): even
    batches need no shadow collectives. ``even_batches`` overrides that setting of the prepared
    ``loaders`` for the block."""
    if not distributed:
        if not single_process:
            warnings.warn("join_uneven_inputs is only supported for multi-GPU (and multi-CPU) DDP training; "
                          "here it has no effect", stacklevel=3)
        yield
        return
    overridden: list[tuple[ShardedBatchSampler, bool]] = []
    if even_batches is not None:
        for loader in loaders:
            shard = getattr(loader, "_shard", None)
            if isinstance(shard, ShardedBatchSampler):
                overridden.append((shard, shard.even_batches))
                shard.even_batches = even_batches
            elif isinstance(shard, IterableDatasetShard):
                warnings.warn("overriding even_batches works for map-style datasets only; an iterable "
                              "dataset's loader keeps its own", stacklevel=3)
    else:
        even_batches = default_even_batches
    try:
        from torch.distributed.algorithms.join import Join

        joinable = [j for j in joinables if isinstance(j, DistributedDataParallel) or hasattr(j, "join_hook")]
        with Join(joinable, enable=not even_batches, throw_on_early_termination=False):
            yield
    finally:
        for shard, value in overridden:
            shard.even_batches = value


@contextlib.contextmanager
def trigger_sync_in_backward(model: torch.nn.Module) -> Iterator[None]:
    """Make the next backward of a DDP ``model`` all-reduce, even inside ``no_sync`` or an
    accumulating micro-step (for several forwards before one backward); FSDP2's likewise."""
    if not isinstance(model, DistributedDataParallel):
        with forced_gradient_sync(model):
            yield
        return
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])  # DDP's own call before a synchronising backward
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved
