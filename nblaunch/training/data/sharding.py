"""This rank's share of the data: batches out of any batch sampler (map-style datasets) or
samples out of a stream (iterable datasets).

Map-style: the original batch sampler runs unchanged on every rank and batch ``i`` goes to rank
``i % P``.

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
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from nblaunch.training.data.shuffle import HookedSampler

__all__ = ["ShardedBatchSampler", "IterableDatasetShard"]


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

    def skip_first(self, batches: int) -> bool:
        """Leave out this rank's first ``batches`` at the next iteration, at the index level (the
        skipped batches are never loaded); True: done here."""
        self.skip = batches
        return True

    def real_in_last_round(self, in_workers: bool) -> int:
        """Real samples in the last round of the last epoch, or -1 when it holds no repeated ones."""
        return self.last_round_real

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
        if isinstance(sampler, HookedSampler) and sampler.policy.generator is not None:
            sampler.policy.at_sampler_start()  # what iterating it would do first
            sampler = sampler.sampler
        kind = type(sampler)
        if kind is SequentialSampler:
            return list(range(len(sampler.data_source)))
        if (kind is RandomSampler and not sampler.replacement and sampler.generator is not None
                and sampler.num_samples == len(sampler.data_source)):
            # What RandomSampler yields, without a Python step per index. It then draws one more
            # permutation (sliced to nothing); drawing it too keeps the generator where
            # RandomSampler would leave it, so the next epoch's order is the same as well.
            indices = torch.randperm(sampler.num_samples, generator=sampler.generator).tolist()
            torch.randperm(sampler.num_samples, generator=sampler.generator)
            return indices
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

    def skip_first(self, batches: int) -> bool:
        """False: a stream's skipped batches must be read (the prepared loader reads past them)."""
        return False

    def real_in_last_round(self, in_workers: bool) -> int:
        """Real samples in the last round of the last epoch, or -1 when it holds no repeated ones.
        ``in_workers``: the shard ran in DataLoader worker processes, whose counts stay there, so
        the answer is worked out from the dataset's length (-1 without one)."""
        if not in_workers:
            return self.last_round_real
        try:
            n = len(self.dataset)  # type: ignore[arg-type]
        except TypeError:
            return -1
        rest = n % (self.batch_size * self.num_processes)
        return rest if rest and self.even_batches and not self.drop_last else -1

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
