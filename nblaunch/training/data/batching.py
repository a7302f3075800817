"""How a user's DataLoader makes its batches, read for a prepared copy: its constructor
arguments (:func:`loader_kwargs`), its batch sampler, and its shuffle taken over by a
:class:`~nblaunch.training.data.shuffle.ShufflePolicy` (:func:`map_style_batching`). The user's
loader and sampler are never changed: the prepared loader gets copies.

Example::

    kwargs = loader_kwargs(loader)
    batching = map_style_batching(loader, kwargs, readers=2, seedable=False, data_seed=None)
    batching.batch_sampler   # a copy whose sampler draws from batching.shuffle's generator
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
from torch.utils.data._utils.collate import default_collate, default_convert
from torch.utils.data.distributed import DistributedSampler

from nblaunch.training.data.shuffle import (GlobalRngAtPass, HookedSampler, SeedableRandomSampler, SeededByEpoch,
                                            SharedGenerator, ShufflePolicy)
from nblaunch.training.runtime.collectives import broadcast_object_list

__all__ = ["Batching", "loader_kwargs", "map_style_batching", "shuffle_for"]


def loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    for name in ("pin_memory_device", "in_order"):
        if hasattr(loader, name):
            kwargs[name] = getattr(loader, name)
    return kwargs


@dataclass
class Batching:
    """How a map-style DataLoader makes its batches, with the shuffle taken over by a policy."""

    batch_sampler: Any
    batch_size: int | None  # None: a custom batch sampler that does not say
    drop_last: bool
    shuffle: ShufflePolicy | None
    epoch_sampler: Any  # a user's DistributedSampler, told the epoch


def map_style_batching(loader: DataLoader, kwargs: dict[str, Any], readers: int,
                       seedable: bool, data_seed: int | None) -> Batching:
    """The batching of ``loader`` for a prepared copy (``kwargs``, from :func:`loader_kwargs`,
    are adjusted to it); ``readers`` processes iterate the sampler (1 when rank 0 reads for all)."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is None and isinstance(loader.sampler, BatchSampler):
        # DataLoader(sampler=BatchSampler(...), batch_size=None): the sampler makes the batches.
        batch_sampler = loader.sampler
        if kwargs["collate_fn"] is default_convert:
            kwargs["collate_fn"] = default_collate  # batches of samples, collated as torch would
    if batch_sampler is None:
        raise ValueError("prepare() needs a batched DataLoader (batch_size or batch_sampler set)")
    sampler = getattr(batch_sampler, "sampler", None)
    batching = Batching(batch_sampler, getattr(batch_sampler, "batch_size", None),
                        bool(getattr(batch_sampler, "drop_last", loader.drop_last)), None, None)
    if isinstance(sampler, DistributedSampler):
        batching.epoch_sampler = sampler  # already sharded by the user: only set_epoch each epoch
    elif sampler is not None and hasattr(sampler, "generator"):
        shuffle, shuffling_sampler = shuffle_for(sampler, readers, seedable, data_seed)
        if loader.generator is not None and loader.generator is sampler.generator:
            kwargs["generator"] = shuffle.generator  # DataLoader(generator=g): one generator, as the user's
        batching.batch_sampler = copy.copy(batch_sampler)
        batching.batch_sampler.sampler = shuffling_sampler
        batching.shuffle = shuffle
    return batching


def shuffle_for(sampler: Any, num_processes: int, seedable: bool,
                 data_seed: int | None) -> tuple[ShufflePolicy, Any]:
    """The shuffle policy for a copy of the user's shuffling ``sampler``, and that copy."""
    if seedable and isinstance(sampler, RandomSampler):
        seed = data_seed if data_seed is not None else torch.random.initial_seed()
        if num_processes > 1:  # rank 0's, should the ranks' initial seeds differ
            [seed] = broadcast_object_list([seed])
        generator = None
        if sampler.generator is not None:
            generator = torch.Generator()
            generator.set_state(sampler.generator.get_state())
        seeded = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                       num_samples=sampler._num_samples, generator=generator, data_seed=seed)
        if generator is None:  # made now, not at the first pass: the policy shares it
            seeded.generator = torch.Generator()
        return SeededByEpoch(seeded), seeded
    if num_processes == 1 and sampler.generator is None:
        policy: ShufflePolicy = GlobalRngAtPass()
    else:
        policy = SharedGenerator(sampler.generator, num_processes)
    return policy, HookedSampler(copy.copy(sampler), policy)
