"""dispatch_batches: rank 0 reads, every rank gets its part (2 real ranks). The batches and their
order are compared with Accelerate's in tests/integrations/test_same_as_accelerate.py; here is
what only nblaunch promises."""

import os

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from nblaunch.training import Accelerator, DataLoaderConfiguration

DISPATCH = DataLoaderConfiguration(dispatch_batches=True)


class CountingStream(IterableDataset):
    """Counts, per rank, the items read."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at = n, fail_at
        self.read = 0

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise KeyError(f"record {i} is missing")
            self.read += 1
            yield i


def _only_rank_0_reads():
    acc = Accelerator()  # iterable datasets are dispatched by default
    stream = CountingStream(20)
    loader = acc.prepare(DataLoader(stream, batch_size=4))
    batches = [b.tolist() for b in loader]
    return {"read": stream.read, "batches": batches, "type": type(loader).__name__}


def test_only_rank_0_reads_the_data_and_every_rank_gets_its_part(launch):
    results = launch(_only_rank_0_reads)
    assert [r["read"] for r in results] == [20, 0]
    assert [r["type"] for r in results] == ["DataLoaderDispatcher"] * 2
    # Rounds of two batches; the last round (4 items) is split evenly.
    assert results[0]["batches"] == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17]]
    assert results[1]["batches"] == [[4, 5, 6, 7], [12, 13, 14, 15], [18, 19]]


def _read_failure():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(CountingStream(20, fail_at=9), batch_size=4))
    got = []
    try:
        for batch in loader:
            got.append(batch.tolist())
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "batches": len(got)}
    return {"error": None}


def test_a_read_failure_on_rank_0_fails_every_rank_instead_of_hanging(launch):
    results = launch(_read_failure)
    assert results[0]["error"] == "KeyError: 'record 9 is missing'"
    assert results[1]["error"] == ("RuntimeError: rank 0 failed to read the batches it dispatches: "
                                   "KeyError: 'record 9 is missing'")
    assert [r["batches"] for r in results] == [0, 0]  # the read-ahead round failed before the first


def _ragged_batches():
    acc = Accelerator(dataloader_config=DISPATCH)
    # A collate function making batches of different widths: they cannot be put together.
    loader = DataLoader(list(range(8)), batch_size=2, collate_fn=lambda items: torch.zeros(2, items[0] + 1))
    loader = acc.prepare(loader)
    try:
        next(iter(loader))
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def test_batches_that_cannot_be_joined_give_every_rank_an_error_that_says_what_to_do(launch):
    results = launch(_ragged_batches)
    assert "split_batches=True" in results[0] and "dispatch_batches=False" in results[0]
    assert results[1].startswith("RuntimeError: rank 0 failed to read the batches it dispatches: ValueError:")


def _mixed_batches():
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True, split_batches=True))

    def collate(items):
        return {"x": torch.tensor(items), "ids": [f"s{i}" for i in items], "pid": os.getpid()}

    loader = acc.prepare(DataLoader(list(range(6)), batch_size=4, collate_fn=collate))
    return [(b["x"].tolist(), b["ids"], b["pid"]) for b in loader]


def test_non_tensor_parts_of_a_batch_come_from_rank_0(launch):
    results = launch(_mixed_batches)
    # Tensors are sliced; other values (here the collate's own) are rank 0's, whole.
    (x0, ids0, pid0), (x0b, _, _) = results[0]
    (x1, ids1, pid1), (x1b, _, _) = results[1]
    assert (x0, x1, x0b, x1b) == ([0, 1], [2, 3], [4], [5])
    assert ids0 == ids1 == ["s0", "s1", "s2", "s3"] and pid0 == pid1


def test_dispatching_needs_device_placement():
    acc = Accelerator(dataloader_config=DISPATCH)
    with pytest.raises(ValueError, match="dispatch_batches=True needs the batches placed on the device"):
        acc.prepare_data_loader(DataLoader(list(range(4)), batch_size=2), device_placement=False)
