"""``dispatch_batches``: rank 0 reads the data and sends every rank its part (Accelerate's
``DataLoaderDispatcher``, and its default for iterable datasets).

Each step rank 0 reads one round (``num_processes`` batches of the user's loader, concatenated;
with ``split_batches`` one batch) and broadcasts it; every rank keeps its slice. The other ranks
never touch the dataset: for data only one process can read (a stream, a generator, a file read
once). The order is the user's loader's own, as rank 0 iterates it.

A ragged last round (``drop_last=False``) is evened out with the epoch's first samples and
``remainder`` says how many are real, so ``gather_for_metrics`` drops the repeats. If rank 0
fails reading, every rank raises instead of waiting for a round that never comes.

Example::

    config = DataLoaderConfiguration(dispatch_batches=True)
    accelerator = Accelerator(dataloader_config=config)
    loader = accelerator.prepare(DataLoader(stream, batch_size=8))  # only rank 0 reads `stream`
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from nblaunch.training.data.batching import loader_kwargs, map_style_batching
from nblaunch.training.data.prepared import PreparedDataLoader, marking_last
from nblaunch.training.runtime.tree import concatenate, recursively_apply, send_to_device

__all__ = ["DataLoaderDispatcher", "dispatch_data_loader", "slice_tensors"]


def slice_tensors(data: Any, tensor_slice: slice, process_index: int | None = None,
                  num_processes: int | None = None) -> Any:
    """Every tensor in ``data`` sliced along dim 0 (the default ``slice_fn_for_dispatch``)."""
    return recursively_apply(lambda t: t[tensor_slice], data)


class _Spec:
    """A tensor's shape and dtype: what the ranks that receive it allocate."""

    __slots__ = ("shape", "dtype")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


class _ReadFailed:
    """Sent instead of a round when rank 0 failed to read one."""

    def __init__(self, error: BaseException) -> None:
        self.text = f"{type(error).__name__}: {error}"


class DataLoaderDispatcher(PreparedDataLoader):
    """A prepared DataLoader whose batches rank 0 reads and every rank receives its part of.

    Besides :class:`~nblaunch.training.data.prepared.PreparedDataLoader`'s attributes: ``remainder``
    counts the real samples of the last round once it is reached (-1 before).
    """

    def __init__(self, dataset: Any, *, process_index: int, split_batches: bool, drop_ragged_round: bool,
                 slice_fn: Callable | None, round_device: torch.device, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self._non_blocking = kwargs["non_blocking"]
        self._process_index = process_index
        self._split = split_batches
        self._drop_ragged_round = drop_ragged_round
        self._slice_fn = slice_fn or slice_tensors
        self._round_device = round_device
        self._last_round_real = -1

    def __len__(self) -> int:
        whole = super().__len__()  # batches of the user's loader
        if self._split:
            return whole
        P = self._num_processes
        return whole // P if self._drop_ragged_round else -(-whole // P)

    @property
    def remainder(self) -> int:
        return self._last_round_real

    def __iter__(self) -> Iterator[Any]:
        skip = self._start_epoch()
        iterator = self._base_iterator(read=self._process_index == 0)
        return self._dispatched(iterator, skip)

    def _dispatched(self, iterator: Iterator[Any] | None, skip: int) -> Iterator[Any]:
        P, rank = self._num_processes, self._process_index
        if iterator is not None and skip:  # resuming: rank 0 passes over the rounds already used
            for _ in itertools.islice(iterator, skip * (1 if self._split else P)):
                pass
        self._last_round_real = -1
        with self._epoch(skip) as progress:
            first = None  # the epoch's first samples: they even out a ragged last round
            for current, last in marking_last(self._rounds(iterator)):
                if first is None and not self._drop_ragged_round:
                    first = self._slice_fn(current, slice(0, P), process_index=rank, num_processes=P)
                observed = _batch_size(current)
                per_rank = observed // P
                if last and not self._drop_ragged_round and observed % P:
                    per_rank += 1
                    current = concatenate([current, _repeated(first, per_rank * P - observed)])
                part = self._slice_fn(current, slice(rank * per_rank, (rank + 1) * per_rank),
                                      process_index=rank, num_processes=P)
                progress.advance(progress.count + 1)
                if last:
                    self._last_round_real = observed
                    progress.end = True
                yield part

    def _rounds(self, iterator: Iterator[Any] | None) -> Iterator[Any]:
        """The epoch's rounds, on every rank (see :meth:`_next_round`)."""
        while (round_ := self._next_round(iterator)) is not None:
            yield round_

    def _next_round(self, iterator: Iterator[Any] | None) -> Any:
        """The next round on every rank (None: the epoch is over). Rank 0 reads it from
        ``iterator``; the others receive it."""
        P = self._num_processes
        round_ = None
        if iterator is not None:
            try:
                round_ = self._read_round(iterator)
                message = [None if round_ is None else recursively_apply(_Spec, round_)]
            except Exception as error:
                if P > 1:
                    dist.broadcast_object_list([_ReadFailed(error)], src=0)
                raise
        else:
            message = [None]
        if P == 1:
            return round_
        dist.broadcast_object_list(message, src=0)
        structure = message[0]
        if isinstance(structure, _ReadFailed):
            raise RuntimeError(f"rank 0 failed to read the batches it dispatches: {structure.text}")
        if structure is None:
            return None
        if round_ is None:
            device = self._round_device
            round_ = recursively_apply(lambda s: torch.empty(s.shape, dtype=s.dtype, device=device),
                                       structure, leaf=_Spec)
        return recursively_apply(lambda t: dist.broadcast(t, src=0) or t, round_)

    def _read_round(self, iterator: Iterator[Any]) -> Any:
        """Rank 0: the next round from the user's loader, on the device (None: no more)."""
        wanted = 1 if self._split else self._num_processes
        batches = list(itertools.islice(iterator, wanted))
        if not batches or (len(batches) < wanted and self._drop_ragged_round):
            return None
        if len(batches) == 1:
            round_ = batches[0]
        else:
            try:
                round_ = concatenate(batches)
            except (RuntimeError, TypeError) as error:
                raise ValueError(
                    "dispatch_batches=True joins num_processes batches into one and these cannot be "
                    f"joined ({error}); pass split_batches=True (rank 0 reads one batch and splits it) "
                    "or dispatch_batches=False (every rank reads its own batches)") from None
        return send_to_device(round_, self._round_device, self._non_blocking)


def _batch_size(data: Any) -> int:
    """Dim 0 of the first tensor in a nested batch."""
    found: list[int] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        if not found:
            found.append(t.shape[0] if t.ndim else 1)
        return t

    recursively_apply(note, data)
    if not found:
        raise TypeError(f"dispatch_batches=True needs batches holding tensors, got {type(data).__name__}")
    return found[0]


def _repeated(samples: Any, count: int) -> Any:
    """The first ``count`` samples of ``samples`` repeated as often as needed."""
    have = _batch_size(samples)
    times = -(-count // have)
    whole = samples if times == 1 else concatenate([samples] * times)
    return recursively_apply(lambda t: t[:count], whole)


def dispatch_data_loader(loader: DataLoader, *, num_processes: int, process_index: int,
                         device: torch.device, gradient_state: Any, split_batches: bool = False,
                         non_blocking: bool = False, seedable_sampler: bool = False,
                         data_seed: int | None = None, slice_fn: Callable | None = None) -> DataLoaderDispatcher:
    """The :class:`DataLoaderDispatcher` of ``loader`` (which is left untouched); rounds travel on
    ``device``."""
    P = num_processes
    kwargs = loader_kwargs(loader)
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        bs = loader.batch_size
        if bs is None:
            raise ValueError("prepare() needs a batched DataLoader (batch_size set) for an iterable dataset")
        sampling: dict[str, Any] = dict(batch_size=bs, drop_last=loader.drop_last)
        shuffle = epoch_sampler = None
    else:
        # Only rank 0 iterates the sampler, so its shuffle is one reader's.
        batching = map_style_batching(loader, kwargs, 1, seedable_sampler, data_seed)
        bs = batching.batch_size
        sampling = dict(batch_sampler=batching.batch_sampler)
        shuffle, epoch_sampler = batching.shuffle, batching.epoch_sampler
    if split_batches and bs is not None and bs > 1 and bs % P:
        raise ValueError(f"split_batches=True needs a batch size divisible by {P}, got {bs}")
    kwargs["generator"] = None  # as Accelerate: rank 0's workers are seeded from the global RNG
    per = None if bs is None else (bs // P if split_batches else bs)
    total = None if bs is None else (bs if split_batches else bs * P)
    return DataLoaderDispatcher(
        dataset, process_index=process_index, split_batches=split_batches,
        drop_ragged_round=loader.drop_last, slice_fn=slice_fn, round_device=device,
        gradient_state=gradient_state, device=None, num_processes=P, shuffle=shuffle,
        rng_types=[], wrapped_sampler=epoch_sampler, shard=None, per_process_batch_size=per,
        total_batch_size=total, non_blocking=non_blocking, **sampling, **kwargs)
