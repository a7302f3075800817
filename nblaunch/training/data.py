"""Sharded, device-placing DataLoaders.

Map-style datasets, with any sampler or batch sampler: the original batch sampler runs unchanged
on every rank and batch ``i`` goes to rank ``i % P``. Shuffling samplers (anything with a
``generator`` attribute: ``RandomSampler``, ``SubsetRandomSampler``, ``WeightedRandomSampler``...)
get a generator reseeded at the start of every epoch with ``seed + epoch``, the seed being rank
0's; so all ranks walk the same permutation, epochs differ, and nobody has to call ``set_epoch``.

- ``even_batches=True`` (default): when the batches do not fill the last round (one batch per
  rank), the round is completed with samples from the start of the epoch, so every rank gets the
  same number of full batches. ``gather_for_metrics`` later drops exactly those samples again.
- ``even_batches=False``: the last round is left short (ranks may get one batch fewer, or a
  smaller last batch).
- ``drop_last=True`` (of the DataLoader): only complete rounds of full batches are used.
- ``split_batches=True``: the DataLoader's batch size is the global one; every batch is cut in
  ``P`` pieces, rank ``r`` takes piece ``r``.

Iterable datasets: each rank reads the whole stream, and out of every ``P`` batches' worth of
samples takes its own slice (so only its own samples are collated and moved).

On XLA the prepared loader does what ``MpDeviceLoader`` does (``torch_xla.sync()`` before every
batch, one transfer to the device), inline: without read-ahead threads, so positions and random
states stay exact.

The prepared loader counts the batches it hands out; that count, the epoch and the seed are the
data position saved by ``save_state``, and :func:`skip_first_batches` skips at the index level
(skipped batches are never loaded) for map-style datasets.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler)
from torch.utils.data._utils.collate import default_collate, default_convert
from torch.utils.data.distributed import DistributedSampler

from nblaunch.training import xla
from nblaunch.training.ops import send_to_device

__all__ = ["ShardedBatchSampler", "IterableDatasetShard", "PreparedDataLoader", "shard_data_loader",
           "skip_first_batches"]


class ShardedBatchSampler(Sampler[list[int]]):
    """This rank's batches out of any batch sampler (see the module docstring for the rules).

    Every rank iterates the full underlying batch sampler, so ranks agree on the rounds without
    talking to each other; only index lists are made for other ranks' batches, never data.

    Example: 10 samples, batch size 3, 2 processes, even_batches -> rank 0 gets
    ``[0, 1, 2], [6, 7, 8]``, rank 1 gets ``[3, 4, 5], [9, 0, 1]``.
    """

    def __init__(self, batch_sampler: Iterable[list[int]], num_processes: int, process_index: int,
                 split_batches: bool = False, even_batches: bool = True,
                 batch_size: int | None = None, drop_last: bool = False) -> None:
        if split_batches and batch_size is not None and batch_size % num_processes:
            raise ValueError(
                f"split_batches=True needs a batch size divisible by the number of processes; "
                f"got batch_size={batch_size} for {num_processes} processes")
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches and num_processes > 1  # one process: nothing to even out
        self.batch_size = batch_size  # the underlying one; None if unknown (custom batch sampler)
        self.drop_last = drop_last
        self.skip = 0  # batches of this rank to leave out at the start of the next iteration
        # Real (not repeated) samples in the last round of the last epoch; -1 if nothing was added.
        self.last_round_real = -1

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    def __len__(self) -> int:
        return self.length_for(self.process_index)

    def length_for(self, rank: int) -> int:
        batches = len(self.batch_sampler)  # type: ignore[arg-type]
        P = self.num_processes
        if self.split_batches:
            if self.even_batches or self.drop_last or self.batch_size is None:
                return batches
            # Without padding a short last batch may leave nothing for the later ranks.
            last = self._last_batch_len(batches)
            piece = self.batch_size // P
            return batches - (1 if last is not None and last <= rank * piece else 0)
        if self.drop_last:
            return batches // P
        if self.even_batches:
            return math.ceil(batches / P)
        return batches // P + (1 if rank < batches % P else 0)

    def _last_batch_len(self, batches: int) -> int | None:
        sampler = self.sampler
        if sampler is None or self.batch_size is None:
            return None
        try:
            n = len(sampler)
        except TypeError:
            return None
        rest = n - (batches - 1) * self.batch_size
        return rest

    def __iter__(self) -> Iterator[list[int]]:
        self.last_round_real = -1
        skip, self.skip = self.skip, 0
        fast = type(self.batch_sampler) is BatchSampler and self.batch_size is not None
        P, B = self.num_processes, self.batch_size
        if self.split_batches:
            source = self._iter_flat(B, B // P) if fast else self._iter_split()
        else:
            source = self._iter_flat(P * B, B) if fast else self._iter_rounds()
        if skip:
            for _ in range(skip):
                if next(source, None) is None:
                    return
        yield from source

    # Without split_batches: batch i -> rank i % P, one round = P consecutive batches.
    def _iter_rounds(self) -> Iterator[list[int]]:
        P, r, bs = self.num_processes, self.process_index, self.batch_size
        first: list[int] = []  # the epoch's first samples, to complete the last round
        round_: list[list[int]] = []
        for batch in self.batch_sampler:
            if len(first) < P * (bs or len(batch)):
                first.extend(batch)
            round_.append(batch)
            if len(round_) == P:
                if bs is None or len(batch) == bs:  # the round is complete and full
                    yield round_[r]
                    round_ = []
                else:  # a short last batch: leave it to the end-of-epoch rules
                    break
        if not round_:
            return
        if self.drop_last:
            return  # an incomplete round is dropped on every rank
        if not self.even_batches:
            if r < len(round_):
                yield round_[r]
            return
        # Complete the round with the epoch's first samples, in order.
        real = sum(len(b) for b in round_)
        if bs is not None:
            while len(first) < P * bs:  # fewer samples than one round: repeat them
                first = first + first
        cursor = 0
        if bs is not None and len(round_[-1]) < bs:
            need = bs - len(round_[-1])
            round_[-1] = list(round_[-1]) + first[:need]
            cursor = need
        while len(round_) < P:
            size = bs if bs is not None else len(round_[0])
            round_.append(first[cursor: cursor + size])
            cursor += size
        self.last_round_real = real
        yield round_[r]

    # torch's own BatchSampler just cuts the sampler's indices in consecutive chunks, so the
    # same batches come from slicing the epoch's index list: no per-batch Python list building
    # for the other ranks' batches (the general path above makes them all).
    def _epoch_indices(self) -> list[int]:
        sampler = self.batch_sampler.sampler  # type: ignore[attr-defined]
        kind = type(sampler)
        if kind is SequentialSampler:
            return list(range(len(sampler.data_source)))
        if (kind is RandomSampler and not sampler.replacement and sampler.generator is not None
                and sampler.num_samples == len(sampler.data_source)):
            # What RandomSampler yields first, without a Python step per index.
            return torch.randperm(sampler.num_samples, generator=sampler.generator).tolist()
        return list(sampler)

    def _head(self, indices: list[int], count: int) -> list[int]:
        """The first ``count`` samples of the epoch, repeated if the epoch is shorter."""
        head = indices[:count]
        while len(head) < count:
            head = head + head
        return head[:count]

    def _iter_flat(self, step: int, take: int) -> Iterator[list[int]]:
        """Fast path for torch's own BatchSampler, slicing the epoch's index list: of every
        ``step`` indices, rank r takes the ``take`` at offset ``r * take``. Without split_batches a
        step is a round of P batches of B; with it, one batch of B split into P pieces."""
        indices = self._epoch_indices()
        full, rest = divmod(len(indices), step)
        start = self.process_index * take
        for base in range(start, full * step, step):
            yield indices[base: base + take]
        if not rest or self.drop_last:
            return
        tail = indices[full * step:]
        if self.even_batches:  # indices is not empty here: rest > 0
            tail = tail + self._head(indices, step - rest)
            self.last_round_real = rest
        part = tail[start: start + take]
        if part:
            yield part

    # With split_batches: every batch is cut in P pieces.
    def _iter_split(self) -> Iterator[list[int]]:
        P, r, bs = self.num_processes, self.process_index, self.batch_size
        first: list[int] = []
        for batch in self.batch_sampler:
            size = bs if bs is not None else len(batch)
            if not first:
                first = list(batch)
            if len(batch) < size:  # the short last batch
                if self.even_batches:
                    real = len(batch)
                    batch = list(batch)
                    while len(batch) < size:
                        batch.extend(first[: size - len(batch)])
                    self.last_round_real = real
                else:
                    piece = size // P
                    part = batch[r * piece: (r + 1) * piece]
                    if part:
                        yield part
                    return
            piece = size // P
            yield batch[r * piece: (r + 1) * piece]


class IterableDatasetShard(IterableDataset):
    """This rank's samples of an iterable dataset: out of every ``P * batch_size`` samples, the
    slice ``[r * batch_size, (r + 1) * batch_size)``.

    A short last group is dropped (``drop_last``), completed from the first samples of the epoch
    (``even_batches``), or split as far as it goes.
    """

    def __init__(self, dataset: Iterable, batch_size: int, num_processes: int, process_index: int,
                 drop_last: bool = False, even_batches: bool = True) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.process_index = process_index
        self.drop_last = drop_last
        self.even_batches = even_batches
        self.last_round_real = -1

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self.dataset)  # type: ignore[arg-type]
        group = self.batch_size * self.num_processes
        full, rest = divmod(n, group)
        if self.drop_last or not rest:
            return full * self.batch_size
        if self.even_batches:
            return (full + 1) * self.batch_size
        mine = min(max(rest - self.process_index * self.batch_size, 0), self.batch_size)
        return full * self.batch_size + mine

    def __iter__(self) -> Iterator[Any]:
        self.last_round_real = -1
        group = self.batch_size * self.num_processes
        lo = self.process_index * self.batch_size
        hi = lo + self.batch_size
        first: list[Any] = []
        buffer: list[Any] = []
        for item in self.dataset:
            buffer.append(item)
            if len(first) < group:
                first.append(item)
            if len(buffer) == group:
                yield from buffer[lo:hi]
                buffer = []
        if not buffer or self.drop_last:
            return
        if self.even_batches:
            real = len(buffer)
            while len(buffer) < group:
                buffer.extend(first[: group - len(buffer)])
            self.last_round_real = real
        yield from buffer[lo:hi]


class PreparedDataLoader(DataLoader):
    """A DataLoader that yields this rank's batches on this rank's device.

    Extra attributes: ``epoch`` (of the next or current iteration), ``seed`` (of the shuffle),
    ``batches_consumed`` (in the current epoch), ``end_of_dataloader``, ``total_batch_size``,
    ``total_dataset_length``, ``remainder``; ``set_epoch(epoch)`` chooses the next epoch.
    """

    def __init__(self, dataset: Any, *, gradient_state: Any, device: torch.device | None,
                 num_processes: int, shuffle_generator: torch.Generator | None, seed: int | None,
                 wrapped_sampler: Any, shard: Any, per_process_batch_size: int | None,
                 total_batch_size: int | None, non_blocking: bool, **loader_kwargs: Any) -> None:
        super().__init__(dataset, **loader_kwargs)
        set_ = object.__setattr__  # DataLoader forbids setting batch_size after __init__
        set_(self, "batch_size", per_process_batch_size)
        self._gradient_state = gradient_state
        self._device = device if device is not None and device.type != "cpu" else None
        self._feed = _feeder(self._device, non_blocking)
        self._num_processes = num_processes
        self._shuffle_generator = shuffle_generator
        self.seed = seed
        self._wrapped_sampler = wrapped_sampler  # a DistributedSampler we call set_epoch on
        self._shard = shard  # ShardedBatchSampler / IterableDatasetShard / None
        self.total_batch_size = total_batch_size
        self.epoch = 0  # of the next iteration, until one starts
        self._current_epoch = 0
        # Updated every batch: a slotted object, because DataLoader.__setattr__ is slow Python.
        self._progress = _Progress()
        self._skip = 0  # batches to skip at the start of the next iteration
        self._restore_rng = False  # resuming mid-epoch: do not let iter() draw from the RNG

    @property
    def device(self) -> torch.device | None:
        """Where batches are placed (None: left where the collate function put them, the CPU)."""
        return self._device

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch handed out so far (skipped ones included)."""
        return self._progress.count

    @property
    def end_of_dataloader(self) -> bool:
        """True from the moment the epoch's last batch is handed out."""
        return self._progress.end

    # -- epochs and positions -----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (optional: epochs advance by themselves)."""
        self.epoch = epoch

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    @property
    def remainder(self) -> int:
        """Real samples in the last round of the epoch, or -1 when it holds no repeated ones."""
        shard = self._shard
        if shard is None:
            return -1
        if isinstance(shard, IterableDatasetShard) and self.num_workers > 0:
            # The shard ran in the worker processes: work it out from the length, if known.
            try:
                n = len(shard.dataset)  # type: ignore[arg-type]
            except TypeError:
                return -1
            rest = n % (shard.batch_size * shard.num_processes)
            return rest if rest and shard.even_batches and not shard.drop_last else -1
        return shard.last_round_real

    def state_dict(self) -> dict:
        """The data position: saved by ``save_state``."""
        if self._skip:  # loaded but not iterated yet
            return {"epoch": self.epoch, "seed": self.seed, "batches_consumed": self._skip}
        progress = self._progress
        if progress.end or progress.count == 0 or not progress.in_epoch:
            return {"epoch": self.epoch, "seed": self.seed, "batches_consumed": 0}
        return {"epoch": self._current_epoch, "seed": self.seed,
                "batches_consumed": self.batches_consumed}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration continues the saved epoch after its consumed batches."""
        self.epoch = int(state["epoch"])
        if state.get("seed") is not None:
            self.seed = int(state["seed"])
        self._skip = int(state.get("batches_consumed", 0))
        self._restore_rng = self._skip > 0

    # -- iteration ----------------------------------------------------------------------------

    def _start_epoch(self) -> int:
        epoch = self.epoch
        self._current_epoch = epoch
        self.epoch = epoch + 1
        if self._shuffle_generator is not None:
            self._shuffle_generator.manual_seed(self.seed + epoch)
        if self._wrapped_sampler is not None:
            self._wrapped_sampler.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        skip, self._skip = self._skip, 0
        return skip

    def __iter__(self) -> Iterator[Any]:
        skip = self._start_epoch()
        shard = self._shard
        index_skip = isinstance(shard, ShardedBatchSampler) and skip > 0
        if index_skip:
            shard.skip = skip
        if self._restore_rng:
            # The uninterrupted run drew from the global RNG when this epoch's iterator was made,
            # before the checkpoint; drawing again would shift every later random number.
            self._restore_rng = False
            rng = torch.get_rng_state()
            iterator = super().__iter__()
            torch.set_rng_state(rng)
        else:
            iterator = super().__iter__()
        return self._batches(iterator, skip, index_skip)

    def _batches(self, iterator: Iterator[Any], skip: int, index_skip: bool) -> Iterator[Any]:
        gs = self._gradient_state
        feed = self._feed
        progress = self._progress = _Progress()  # a fresh one: an abandoned epoch keeps its own
        progress.count = skip
        progress.in_epoch = True
        if skip and not index_skip:
            for _ in range(skip):  # iterable datasets: the skipped batches must be read
                if next(iterator, None) is None:
                    break
        gs._enter_loader(self)
        try:
            try:
                length = len(self)
            except TypeError:
                length = None
            if length is not None:
                # Known length: the last batch is found by counting, no read-ahead.
                last = length - 1
                count = skip
                for batch in iterator:
                    if count >= last:
                        progress.end = True
                    count += 1
                    progress.count = count
                    if feed is not None:
                        batch = feed(batch)
                    yield batch
            else:
                # Unknown length: hold one batch back to know which is the last.
                count = skip
                current = next(iterator, _END)
                while current is not _END:
                    following = next(iterator, _END)
                    if following is _END:
                        progress.end = True
                    count += 1
                    progress.count = count
                    if feed is not None:
                        current = feed(current)
                    yield current
                    current = following
            progress.end = True
        finally:
            progress.in_epoch = not progress.end
            gs._leave_loader(self)


_END = object()


def _feeder(device: torch.device | None, non_blocking: bool) -> Callable[[Any], Any] | None:
    """What happens to every batch: nothing (CPU), a copy to the device, or on XLA also the
    step's ``torch_xla.sync()``."""
    if device is None:
        return None
    if device.type == "xla":
        return xla.device_feeder(device)
    return functools.partial(send_to_device, device=device, non_blocking=non_blocking)


class _Progress:
    __slots__ = ("count", "end", "in_epoch")

    def __init__(self) -> None:
        self.count = 0
        self.end = False
        self.in_epoch = False


class _SkipView:
    """What :func:`skip_first_batches` returns: iterates its loader's current epoch from batch n."""

    def __init__(self, loader: PreparedDataLoader, num_batches: int) -> None:
        self._loader = loader
        self._num_batches = num_batches

    def __iter__(self) -> Iterator[Any]:
        self._loader._skip = self._num_batches  # counted from the start of the epoch
        return iter(self._loader)

    def __len__(self) -> int:
        return max(len(self._loader) - self._num_batches, 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """Iterate ``dataloader`` from batch ``num_batches`` of its next epoch.

    For a prepared loader the skipped batches are never loaded (map-style datasets) and the epoch
    counter is the loader's own, so after the shortened epoch the loader goes on with the next
    epoch. ``num_batches`` counts from the start of the epoch: after ``load_state`` (which already
    resumes mid-epoch by itself) passing the saved position again does not skip twice.
    A plain DataLoader gets a generator that drops the first batches.
    """
    if isinstance(dataloader, _SkipView):
        dataloader = dataloader._loader
    if isinstance(dataloader, PreparedDataLoader):
        return _SkipView(dataloader, num_batches)

    def skipping() -> Iterator[Any]:
        for i, batch in enumerate(dataloader):
            if i >= num_batches:
                yield batch

    return skipping()


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
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


def _shared_seed(generator: torch.Generator | None, num_processes: int, device: torch.device) -> int:
    # device: where the collective runs (cuda for nccl, cpu for gloo, xla)
    """A shuffle seed drawn on every rank (so RNG streams stay aligned) and taken from rank 0."""
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    if device.type == "xla":
        seed = xla.broadcast_object(seed, 0)
    elif num_processes > 1:
        import torch.distributed as dist
        t = torch.tensor([seed], dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        seed = int(t.item())
    return seed


def shard_data_loader(loader: DataLoader, *, num_processes: int, process_index: int,
                        device: torch.device | None, gradient_state: Any,
                        split_batches: bool = False, even_batches: bool = True,
                        non_blocking: bool = False,
                        comm_device: torch.device | None = None) -> PreparedDataLoader:
    """Build the rank's :class:`PreparedDataLoader` for ``loader`` (which is left untouched)."""
    import copy

    kwargs = _loader_kwargs(loader)
    dataset = loader.dataset
    common = dict(gradient_state=gradient_state, device=device, num_processes=num_processes,
                  non_blocking=non_blocking)
    P = num_processes

    if isinstance(dataset, IterableDataset):
        bs = loader.batch_size
        if bs is None:
            raise ValueError("prepare() needs a batched DataLoader (batch_size set) for an iterable dataset")
        if split_batches:
            if bs % P:
                raise ValueError(f"split_batches=True needs a batch size divisible by {P}, got {bs}")
            per = bs // P
        else:
            per = bs
        shard = None
        if P > 1:
            shard = IterableDatasetShard(dataset, per, P, process_index, drop_last=loader.drop_last,
                                         even_batches=even_batches)
            data = shard
        else:
            data = dataset
        return PreparedDataLoader(data, shuffle_generator=None, seed=None, wrapped_sampler=None,
                                  shard=shard, per_process_batch_size=per,
                                  total_batch_size=per * P, batch_size=per,
                                  drop_last=loader.drop_last, **common, **kwargs)

    batch_sampler = loader.batch_sampler
    if batch_sampler is None and isinstance(loader.sampler, BatchSampler):
        # DataLoader(sampler=BatchSampler(...), batch_size=None): the sampler makes the batches.
        batch_sampler = loader.sampler
        if kwargs["collate_fn"] is default_convert:
            kwargs["collate_fn"] = default_collate  # batches of samples, collated as torch would
    if batch_sampler is None:
        raise ValueError("prepare() needs a batched DataLoader (batch_size or batch_sampler set)")
    sampler = getattr(batch_sampler, "sampler", None)
    bs = getattr(batch_sampler, "batch_size", None)
    drop_last = bool(getattr(batch_sampler, "drop_last", loader.drop_last))

    # A shuffling sampler gets our generator (in a copy: the user's objects stay as they are).
    generator = seed = None
    wrapped_sampler = None
    if isinstance(sampler, DistributedSampler):
        wrapped_sampler = sampler  # already sharded by the user: only set_epoch each epoch
    elif sampler is not None and hasattr(sampler, "generator"):
        seed = _shared_seed(sampler.generator, P, comm_device or torch.device("cpu"))
        generator = torch.Generator()
        sampler = copy.copy(sampler)
        sampler.generator = generator
        batch_sampler = copy.copy(batch_sampler)
        batch_sampler.sampler = sampler

    shard = None
    per = bs
    total = bs
    # With one process the sharded sampler only pays off on its slicing path (torch's own
    # BatchSampler), where it is faster than BatchSampler's per-index loop.
    fast = type(batch_sampler) is BatchSampler and bs is not None
    if wrapped_sampler is None and (P > 1 or fast):
        shard = ShardedBatchSampler(batch_sampler, P, process_index, split_batches=split_batches,
                                    even_batches=even_batches, batch_size=bs, drop_last=drop_last)
        batch_sampler = shard
        if bs is not None:
            per, total = (bs // P, bs) if split_batches else (bs, bs * P)
    elif bs is not None:
        total = bs * P if wrapped_sampler is not None else bs
    return PreparedDataLoader(dataset, shuffle_generator=generator, seed=seed,
                              wrapped_sampler=wrapped_sampler, shard=shard,
                              per_process_batch_size=per, total_batch_size=total,
                              batch_sampler=batch_sampler, **common, **kwargs)
