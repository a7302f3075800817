"""Turning a user's DataLoader into this rank's prepared one, under Accelerate's names and
signatures (``accelerate.data_loader``): ``Accelerator.prepare`` comes here, and so does code
that calls :func:`prepare_data_loader` directly.

Two ways, as in Accelerate: every rank reads its own shard (:func:`shard_data_loader`), or rank 0
reads and sends every rank its part (``dispatch_batches``, :mod:`nblaunch.training.data.dispatch`;
the default for iterable datasets).

Example::

    from nblaunch import PartialState, prepare_data_loader
    state = PartialState()
    loader = prepare_data_loader(loader, state.device, state.num_processes, state.process_index)
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from nblaunch.training.data.batching import loader_kwargs, map_style_batching
from nblaunch.training.data.dispatch import DataLoaderDispatcher, dispatch_data_loader
from nblaunch.training.data.prepared import PreparedDataLoader
from nblaunch.training.data.sharding import IterableDatasetShard, ShardedBatchSampler
from nblaunch.training.data.shuffle import SeedableRandomSampler
from nblaunch.training.options.kwargs import DataLoaderConfiguration, refuse_unsupported
from nblaunch.training.runtime.state import PartialState
from nblaunch.training.step.gradient_state import GradientState

__all__ = ["prepare_data_loader", "build_prepared_loader", "shard_data_loader",
           "SeedableRandomSampler", "DataLoaderDispatcher"]


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None,
                        num_processes: int | None = None, process_index: int | None = None,
                        split_batches: bool = False, put_on_device: bool = False,
                        rng_types: list | None = None, dispatch_batches: bool | None = None,
                        even_batches: bool = True, slice_fn_for_dispatch: Callable | None = None,
                        use_seedable_sampler: bool = False, data_seed: int | None = None,
                        non_blocking: bool = False, use_stateful_dataloader: bool = False) -> PreparedDataLoader:
    """This rank's share of ``dataloader``, as ``Accelerator.prepare`` makes it."""
    refuse_unsupported(DataLoaderConfiguration(use_stateful_dataloader=use_stateful_dataloader))
    state = PartialState()
    return build_prepared_loader(
        dataloader,
        num_processes=state.num_processes if num_processes is None else num_processes,
        process_index=state.process_index if process_index is None else process_index,
        device=(device if device is not None else state.device) if put_on_device else None,
        gradient_state=GradientState(), split_batches=split_batches, even_batches=even_batches,
        non_blocking=non_blocking, rng_types=rng_types, seedable_sampler=use_seedable_sampler,
        data_seed=data_seed, dispatch_batches=dispatch_batches, slice_fn=slice_fn_for_dispatch)


def build_prepared_loader(loader: DataLoader, *, num_processes: int, process_index: int,
                          device: torch.device | None, gradient_state: Any,
                          split_batches: bool = False, even_batches: bool = True,
                          non_blocking: bool = False, rng_types: list[Any] | None = None,
                          seedable_sampler: bool = False, data_seed: int | None = None,
                          dispatch_batches: bool | None = None,
                          slice_fn: Callable | None = None) -> PreparedDataLoader:
    """Shard or dispatch, as Accelerate decides: ``dispatch_batches=None`` dispatches iterable
    datasets whose batches are placed on the device (``device`` not None), except on XLA."""
    on_xla = device is not None and device.type == "xla"
    if dispatch_batches is None:
        dispatch_batches = device is not None and not on_xla and isinstance(loader.dataset, IterableDataset)
    if dispatch_batches:
        if device is None:
            raise ValueError("dispatch_batches=True needs the batches placed on the device "
                             "(put_on_device=True / device_placement=True)")
        if on_xla:
            raise ValueError("dispatch_batches=True is not supported on TPU (XLA), as in Accelerate: "
                             "leave it unset so that every rank reads its own batches")
        return dispatch_data_loader(
            loader, num_processes=num_processes, process_index=process_index, device=device,
            gradient_state=gradient_state, split_batches=split_batches, non_blocking=non_blocking,
            seedable_sampler=seedable_sampler, data_seed=data_seed, slice_fn=slice_fn)
    return shard_data_loader(
        loader, num_processes=num_processes, process_index=process_index, device=device,
        gradient_state=gradient_state, split_batches=split_batches, even_batches=even_batches,
        non_blocking=non_blocking, rng_types=rng_types, seedable_sampler=seedable_sampler,
        data_seed=data_seed)


def shard_data_loader(loader: DataLoader, *, num_processes: int, process_index: int,
                      device: torch.device | None, gradient_state: Any,
                      split_batches: bool = False, even_batches: bool = True,
                      non_blocking: bool = False, rng_types: list[Any] | None = None,
                      seedable_sampler: bool = False,
                      data_seed: int | None = None) -> PreparedDataLoader:
    """Every rank reads its own batches of ``loader`` (which is left untouched).

    ``rng_types``: Accelerate's (``"generator"`` is the shuffle's own generator and always kept
    in step; ``"torch"``/``"cuda"`` get rank 0's state at every epoch start).
    ``seedable_sampler``/``data_seed``: a ``RandomSampler`` shuffles epoch ``e`` with
    ``data_seed + e`` (default: torch's initial seed), as Accelerate's ``use_seedable_sampler``.
    """
    kwargs = loader_kwargs(loader)
    dataset = loader.dataset
    # Accelerate's RNGType members or their names; "generator" is the shuffle's, kept in step anyway.
    names = [str(getattr(kind, "value", kind)) for kind in rng_types or []]
    rng_types = [name for name in names if name != "generator"] if num_processes > 1 else []
    common = dict(gradient_state=gradient_state, device=device, num_processes=num_processes,
                  non_blocking=non_blocking, rng_types=rng_types)
    P = num_processes

    if isinstance(dataset, IterableDataset):
        bs = loader.batch_size
        if bs is None:
            raise ValueError("prepare() needs a batched DataLoader (batch_size set) for an iterable dataset")
        if split_batches and bs % P:
            raise ValueError(f"split_batches=True needs a batch size divisible by {P}, got {bs}")
        per = bs // P if split_batches else bs
        shard = None
        if P > 1:
            shard = IterableDatasetShard(dataset, per, P, process_index, drop_last=loader.drop_last,
                                         even_batches=even_batches)
        return PreparedDataLoader(shard if shard is not None else dataset, shuffle=None, wrapped_sampler=None,
                                  shard=shard, per_process_batch_size=per,
                                  total_batch_size=per * P, batch_size=per,
                                  drop_last=loader.drop_last, **common, **kwargs)

    batching = map_style_batching(loader, kwargs, P, seedable_sampler, data_seed)
    batch_sampler, bs = batching.batch_sampler, batching.batch_size
    shard = None
    per = total = bs
    # With one process the sharded sampler only pays off on its slicing path (torch's own
    # BatchSampler), where it is faster than BatchSampler's per-index loop.
    fast = type(batch_sampler) is BatchSampler and bs is not None
    if batching.epoch_sampler is None and (P > 1 or fast):
        shard = ShardedBatchSampler(batch_sampler, P, process_index, split_batches=split_batches,
                                    even_batches=even_batches, batch_size=bs, drop_last=batching.drop_last)
        batch_sampler = shard
        if bs is not None:
            per, total = (bs // P, bs) if split_batches else (bs, bs * P)
    elif bs is not None:
        total = bs * P if batching.epoch_sampler is not None else bs
    return PreparedDataLoader(dataset, shuffle=batching.shuffle,
                              wrapped_sampler=batching.epoch_sampler, shard=shard,
                              per_process_batch_size=per, total_batch_size=total,
                              batch_sampler=batch_sampler, **common, **kwargs)
