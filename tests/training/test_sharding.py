"""The sharding rules, checked on the batch sampler itself (no processes needed)."""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from nblaunch.training.data.sharding import IterableDatasetShard, ShardedBatchSampler


def shards(n, bs, P, drop_last=False, **kw):
    out = []
    for r in range(P):
        base = BatchSampler(SequentialSampler(range(n)), bs, drop_last)
        s = ShardedBatchSampler(base, P, r, batch_size=bs, drop_last=drop_last, **kw)
        batches = [list(b) for b in s]
        assert len(s) == len(batches), (r, len(s), batches)
        out.append(batches)
    return out


def test_even_batches_completes_last_round_from_epoch_start():
    assert shards(10, 3, 2) == [
        [[0, 1, 2], [6, 7, 8]],
        [[3, 4, 5], [9, 0, 1]],
    ]


def test_uneven_batches_left_short():
    assert shards(10, 3, 2, even_batches=False) == [
        [[0, 1, 2], [6, 7, 8]],
        [[3, 4, 5], [9]],
    ]
    # 13 samples: 5 batches, rank 0 gets one more
    assert shards(13, 3, 2, even_batches=False) == [
        [[0, 1, 2], [6, 7, 8], [12]],
        [[3, 4, 5], [9, 10, 11]],
    ]


def test_drop_last_keeps_only_complete_rounds():
    assert shards(10, 3, 2, drop_last=True) == [[[0, 1, 2]], [[3, 4, 5]]]
    assert shards(10, 3, 2, drop_last=True, even_batches=False) == [[[0, 1, 2]], [[3, 4, 5]]]


def test_even_batches_adds_whole_batches_when_rounds_are_short():
    # 3 full batches for 2 ranks: the missing 4th batch comes from the epoch start
    assert shards(9, 3, 2) == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [0, 1, 2]]]
    # fewer samples than one round: repeated
    assert shards(2, 3, 2) == [[[0, 1, 0]], [[1, 0, 1]]]


def test_split_batches():
    assert shards(10, 4, 2, split_batches=True) == [
        [[0, 1], [4, 5], [8, 9]],
        [[2, 3], [6, 7], [0, 1]],
    ]
    assert shards(10, 4, 2, split_batches=True, even_batches=False) == [
        [[0, 1], [4, 5], [8, 9]],
        [[2, 3], [6, 7]],
    ]
    with pytest.raises(ValueError, match="divisible"):
        shards(10, 3, 2, split_batches=True)


def test_remainder_counts_real_samples_of_last_round():
    base = BatchSampler(SequentialSampler(range(10)), 3, False)
    s = ShardedBatchSampler(base, 2, 1, batch_size=3)
    list(s)
    assert s.last_round_real == 4  # [6, 7, 8] + [9]; [0, 1] are repeats
    s = ShardedBatchSampler(BatchSampler(SequentialSampler(range(12)), 3, False), 2, 0, batch_size=3)
    list(s)
    assert s.last_round_real == -1


def test_skip_is_index_level():
    base = BatchSampler(SequentialSampler(range(20)), 2, False)
    s = ShardedBatchSampler(base, 2, 1, batch_size=2)
    s.skip = 2
    assert [list(b) for b in s] == [[10, 11], [14, 15], [18, 19]]
    assert [list(b) for b in s][0] == [2, 3]  # skip applies to one iteration only


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def test_iterable_shard_slices_every_round():
    got = [list(IterableDatasetShard(Stream(10), 3, 2, r)) for r in range(2)]
    assert got == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 0, 1]]
    got = [list(IterableDatasetShard(Stream(10), 3, 2, r, even_batches=False)) for r in range(2)]
    assert got == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9]]
    got = [list(IterableDatasetShard(Stream(10), 3, 2, r, drop_last=True)) for r in range(2)]
    assert got == [[0, 1, 2], [3, 4, 5]]


class MyBatchSampler(BatchSampler):
    """A subclass: takes the general path (the exact BatchSampler takes the slicing path)."""


@pytest.mark.parametrize("split", [False, True])
def test_general_and_slicing_paths_agree(split):
    for n in range(0, 27):
        for bs in (2, 4):
            for P in (1, 2, 3) if not split else (1, 2):
                for drop_last in (False, True):
                    for even in (False, True):
                        for r in range(P):
                            kw = dict(batch_size=bs, drop_last=drop_last, even_batches=even, split_batches=split)
                            fast = ShardedBatchSampler(BatchSampler(SequentialSampler(range(n)), bs, drop_last), P, r, **kw)
                            slow = ShardedBatchSampler(MyBatchSampler(SequentialSampler(range(n)), bs, drop_last), P, r, **kw)
                            got_fast, got_slow = [list(b) for b in fast], [list(b) for b in slow]
                            case = (n, bs, P, r, drop_last, even)
                            assert got_fast == got_slow, case
                            assert len(fast) == len(got_fast), case
                            assert fast.last_round_real == slow.last_round_real, case


def test_one_process_loader_is_the_plain_loader():
    from nblaunch.training import Accelerator

    acc = Accelerator()
    for kw in ({}, {"drop_last": True}, {"shuffle": True}):
        plain = DataLoader(list(range(10)), batch_size=3, **kw)
        prepared = acc.prepare(plain)
        got = [b.tolist() for b in prepared]
        assert len(prepared) == len(plain) == len(got)
        if kw.get("shuffle"):
            assert sorted(x for b in got for x in b) == list(range(10)) and len(got[-1]) == 1
        else:
            assert got == [b.tolist() for b in plain]
