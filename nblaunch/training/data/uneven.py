"""Ranks with different numbers of batches: ``join_uneven_inputs`` (Accelerate's name and
meaning), torch's ``Join`` over the prepared models while the prepared loaders' batches are uneven.

Example::

    with join_uneven_inputs([ddp_model], [loader], distributed=True, single_process=False,
                            default_even_batches=False):
        for batch in loader:   # a rank that runs out first shadows the others' all-reduces
            ...
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from nblaunch.training.data.sharding import IterableDatasetShard, ShardedBatchSampler


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
            shard = getattr(loader, "shard", None)
            if isinstance(shard, ShardedBatchSampler):
                overridden.append((shard, shard.even_batches))
                shard.even_batches = even_batches
            elif isinstance(shard, IterableDatasetShard):
                warnings.warn("overriding even_batches works for map-style datasets only; an iterable "
                              "dataset's loader keeps its own", stacklevel=3)
    else:
        even_batches = default_even_batches
    try:
        joinable = [j for j in joinables if isinstance(j, DistributedDataParallel) or hasattr(j, "join_hook")]
        with Join(joinable, enable=not even_batches, throw_on_early_termination=False):
            yield
    finally:
        for shard, value in overridden:
            shard.even_batches = value
