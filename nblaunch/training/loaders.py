"""Accelerate's data-loader functions and classes under their names and signatures
(``accelerate.data_loader``), for code that calls them directly rather than through
``Accelerator.prepare``.

Example::

    from nblaunch import PartialState, prepare_data_loader
    state = PartialState()
    loader = prepare_data_loader(loader, state.device, state.num_processes, state.process_index)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from nblaunch.training.config import DataLoaderConfiguration, refuse_unsupported
from nblaunch.training.data import PreparedDataLoader, shard_data_loader
from nblaunch.training.shuffle import SeedableRandomSampler
from nblaunch.training.state import GradientState, PartialState

__all__ = ["prepare_data_loader", "SeedableRandomSampler", "DataLoaderDispatcher"]


class DataLoaderDispatcher(PreparedDataLoader):
    """Accelerate's loader for ``dispatch_batches=True`` (rank 0 reads, every rank gets its part).
    nblaunch does not dispatch batches yet (that option is refused); the name exists for code
    that checks ``isinstance`` against it."""


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None,
                        num_processes: int | None = None, process_index: int | None = None,
                        split_batches: bool = False, put_on_device: bool = False,
                        rng_types: list | None = None, dispatch_batches: bool | None = None,
                        even_batches: bool = True, slice_fn_for_dispatch: Any = None,
                        use_seedable_sampler: bool = False, data_seed: int | None = None,
                        non_blocking: bool = False, use_stateful_dataloader: bool = False) -> PreparedDataLoader:
    """This rank's share of ``dataloader``, as ``Accelerator.prepare`` makes it."""
    refuse_unsupported(DataLoaderConfiguration(dispatch_batches=dispatch_batches,
                                               use_stateful_dataloader=use_stateful_dataloader))
    state = PartialState()
    return shard_data_loader(
        dataloader,
        num_processes=state.num_processes if num_processes is None else num_processes,
        process_index=state.process_index if process_index is None else process_index,
        device=device if put_on_device else None, gradient_state=GradientState(),
        split_batches=split_batches, even_batches=even_batches, non_blocking=non_blocking,
        rng_types=rng_types,
        seedable_sampler=use_seedable_sampler, data_seed=data_seed,
    )
