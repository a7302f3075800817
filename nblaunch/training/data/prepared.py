"""Sharded, device-placing DataLoaders: ``Accelerator.prepare`` turns a DataLoader into this
rank's :class:`PreparedDataLoader`.

Which batches a rank gets is ``nblaunch.training.data.sharding``'s business; the shuffle order (the
same as Accelerate's for the same seed) is ``nblaunch.training.data.shuffle``'s. Shuffling samplers
are anything with a ``generator`` attribute (``RandomSampler``, ``SubsetRandomSampler``,
``WeightedRandomSampler``...): the prepared loader uses a copy, the user's objects stay as they
are.

On XLA the prepared loader does what ``MpDeviceLoader`` does (``torch_xla.sync()`` before every
batch, one transfer to the device), inline: without read-ahead threads, so positions and random
states stay exact.

The prepared loader counts the batches it hands out; that count, the epoch and the shuffle
position are the data position saved by ``save_state``, and :func:`skip_first_batches` skips at
the index level (skipped batches are never loaded) for map-style datasets.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader

from nblaunch.training.runtime import xla
from nblaunch.training.runtime.collectives import synchronize_rng_states
from nblaunch.training.runtime.tree import send_to_device
from nblaunch.worker import channel, step_clock, step_stop
from nblaunch.worker.progress import BarReporter

if TYPE_CHECKING:
    from nblaunch.training.data.sharding import IterableDatasetShard, ShardedBatchSampler
    from nblaunch.training.data.shuffle import ShufflePolicy

__all__ = ["PreparedDataLoader", "Progress", "skip_first_batches", "marking_last"]


class PreparedDataLoader(DataLoader):
    """A DataLoader that yields this rank's batches on this rank's device.

    Extra attributes: ``epoch`` (of the next or current iteration), ``batches_consumed`` (in the
    current epoch), ``end_of_dataloader``, ``total_batch_size``, ``total_dataset_length``,
    ``remainder``, ``shard``; ``set_epoch(epoch)`` chooses the next epoch.
    """

    def __init__(self, dataset: Any, *, gradient_state: Any, device: torch.device | None,
                 num_processes: int, shuffle: ShufflePolicy | None, rng_types: list[str] | None,
                 wrapped_sampler: Any, shard: Any, per_process_batch_size: int | None,
                 total_batch_size: int | None, non_blocking: bool, **loader_kwargs: Any) -> None:
        super().__init__(dataset, **loader_kwargs)
        set_ = object.__setattr__  # DataLoader forbids setting batch_size after __init__
        set_(self, "batch_size", per_process_batch_size)
        self._gradient_state = gradient_state
        self._device = device if device is not None and device.type != "cpu" else None
        self._feed = _feeder(self._device, non_blocking)
        self._num_processes = num_processes
        self._shuffle = shuffle
        self._rng_types = rng_types  # Accelerate's: RNGs given rank 0's state at every epoch start
        self._wrapped_sampler = wrapped_sampler  # a DistributedSampler we call set_epoch on
        self._shard = shard  # ShardedBatchSampler / IterableDatasetShard / None
        self.total_batch_size = total_batch_size
        self.epoch = 0  # of the next iteration, until one starts
        self._current_epoch = 0
        # Updated every batch: a slotted object, because DataLoader.__setattr__ is slow Python.
        self._progress = Progress()
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

    @property
    def shard(self) -> ShardedBatchSampler | IterableDatasetShard | None:
        """What picks this rank's batches out of the whole (None: this rank reads them all)."""
        return self._shard

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
        return -1 if shard is None else shard.real_in_last_round(in_workers=self.num_workers > 0)

    def state_dict(self) -> dict:
        """The data position: saved by ``save_state``."""
        progress = self._progress
        if self._skip:  # loaded but not iterated yet
            epoch, consumed = self.epoch, self._skip
        elif progress.end or progress.count == 0 or not progress.in_epoch:
            epoch, consumed = self.epoch, 0
        else:
            epoch, consumed = self._current_epoch, self.batches_consumed
        state = {"epoch": epoch, "batches_consumed": consumed}
        if self._shuffle is not None:
            state.update(self._shuffle.position(mid_epoch=consumed > 0))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration continues the saved epoch after its consumed batches."""
        self.epoch = int(state["epoch"])
        if self._shuffle is not None:
            self._shuffle.resume(state)
        self._skip = int(state.get("batches_consumed", 0))
        self._restore_rng = self._skip > 0

    # -- iteration ----------------------------------------------------------------------------

    def _start_epoch(self) -> int:
        epoch = self.epoch
        self._current_epoch = epoch
        self.epoch = epoch + 1
        if self._rng_types:
            synchronize_rng_states(self._rng_types)
        if self._shuffle is not None:
            self._shuffle.before_epoch(epoch)
        if self._wrapped_sampler is not None:
            self._wrapped_sampler.set_epoch(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        skip, self._skip = self._skip, 0
        return skip

    def __iter__(self) -> Iterator[Any]:
        # Before the epoch starts: a resume loads its position here, and a launch agreed to stop
        # after the last epoch's last step stops here, its end-of-epoch code run, this loader between epochs.
        step_stop.step_end(loader=self)
        skip = self._start_epoch()
        shard = self._shard
        index_skip = skip > 0 and shard is not None and shard.skip_first(skip)
        return self._batches(self._base_iterator(), skip, index_skip)

    def _base_iterator(self, read: bool = True) -> Iterator[Any] | None:
        """The DataLoader's own iterator; ``read=False`` (a rank that is sent its batches) makes
        none but takes the same draw from the global RNG, so every rank's RNG stays in step."""
        restore, self._restore_rng = self._restore_rng, False
        # Resuming: the uninterrupted run drew from the global RNG when this epoch's iterator was
        # made, before the checkpoint; drawing again would shift every later random number.
        rng = torch.get_rng_state() if restore else None
        if read:
            iterator = super().__iter__()
        else:
            iterator = None
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # DataLoader's base seed
        if rng is not None:
            torch.set_rng_state(rng)
        return iterator

    @contextlib.contextmanager
    def _epoch(self, skip: int) -> Iterator[Progress]:
        """An epoch's bookkeeping around the handing out of its batches: a fresh progress (an
        abandoned epoch keeps its own) counted from ``skip``, and the gradient state told which
        loader runs; the progress ends only if the batches ran out."""
        progress = self._progress = Progress()
        progress.count = skip
        progress.in_epoch = True
        progress.bar = _epoch_bar(self, self._current_epoch, skip)
        self._gradient_state.loader_started(self)
        try:
            yield progress
            progress.end = True
        finally:
            progress.in_epoch = not progress.end
            self._gradient_state.loader_stopped(self)
            if progress.bar is not None:
                progress.bar.close(progress.count)

    def _batches(self, iterator: Iterator[Any], skip: int, index_skip: bool) -> Iterator[Any]:
        feed = self._feed
        if skip and not index_skip:
            for _ in range(skip):  # iterable datasets: the skipped batches must be read
                if next(iterator, None) is None:
                    break
        with self._epoch(skip) as progress:
            try:
                length = len(self)
            except TypeError:
                length = None
            clock = step_clock.current()
            batches = marking_last(iterator, length, skip)
            count = skip
            while True:
                if count > skip and not progress.end:  # the step the last batch fed is over: a launch agreed
                    step_stop.step_end(loader=self)  # to stop stops here
                began = time.perf_counter()
                found = next(batches, None)
                if found is None:
                    break
                batch, last = found
                count += 1
                if last:
                    progress.end = True
                progress.advance(count)
                if feed is not None:
                    batch = feed(batch)
                if clock is not None:
                    clock.waited_for_data(began, batch)  # from asking for the batch to having it here
                yield batch


def marking_last(iterator: Iterator[Any], length: int | None = None,
                 skip: int = 0) -> Iterator[tuple[Any, bool]]:
    """``(batch, is_last)`` for every batch after the first ``skip`` of a ``length``-batch epoch:
    with a known length the last one is found by counting, without reading ahead; otherwise one
    batch is held back until the next shows whether it was the last."""
    if length is not None:
        count = skip
        for batch in iterator:
            count += 1
            yield batch, count >= length
        return
    current = next(iterator, _END)
    while current is not _END:
        following = next(iterator, _END)
        yield current, following is _END
        current = following


_END = object()


def _feeder(device: torch.device | None, non_blocking: bool) -> Callable[[Any], Any] | None:
    """What happens to every batch: nothing (CPU), a copy to the device, or on XLA also the
    step's ``torch_xla.sync()``."""
    if device is None:
        return None
    if device.type == "xla":
        return xla.device_feeder(device)
    return functools.partial(send_to_device, device=device, non_blocking=non_blocking)


class Progress:
    """Where an epoch's iteration is: batches handed out, the last one reached, still going;
    inside a launch also the rank's progress bar in the cell (hidden there when the user's
    code draws bars of its own)."""

    __slots__ = ("count", "end", "in_epoch", "bar")

    def __init__(self) -> None:
        self.count = 0
        self.end = False
        self.in_epoch = False
        self.bar: BarReporter | None = None

    def advance(self, count: int) -> None:
        self.count = count
        if self.bar is not None:
            self.bar.update(count)  # throttled: a clock read per batch, a report ~10 times a second


def _epoch_bar(loader: DataLoader, epoch: int, skip: int) -> BarReporter | None:
    if not channel.in_launch():
        return None
    try:
        total = len(loader)
    except TypeError:
        total = None
    bar = BarReporter(total, f"batches, epoch {epoch}", auto=True)
    bar.update(skip)
    return bar


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
