"""Prepared DataLoaders and metric gathering in a real 2-process gloo launch."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, SubsetRandomSampler

from nblaunch.training import Accelerator, DataLoaderConfiguration


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _data_checks():
    out = {}
    # Tables through real prepared loaders (n=10, bs=3).
    for name, kw, dl_kw in [
        ("even", {}, {}),
        ("uneven", {"even_batches": False}, {}),
        ("drop_last", {}, {"drop_last": True}),
        ("split", {"split_batches": True}, {"batch_size": 4}),
    ]:
        acc = Accelerator(**kw)
        loader = acc.prepare(DataLoader(list(range(10)), **{"batch_size": 3, **dl_kw}))
        out[name] = [b.tolist() for b in loader]
        out[name + "_len"] = len(loader)

    # Shuffled: three epochs, no set_epoch.
    acc = Accelerator()
    loader = acc.prepare(DataLoader(list(range(20)), batch_size=2, shuffle=True))
    out["shuffled"] = [[x for b in loader for x in b.tolist()] for _ in range(3)]
    # Any sampler with a generator, e.g. a subset.
    loader = acc.prepare(DataLoader(list(range(20)), batch_size=2,
                                    sampler=SubsetRandomSampler(list(range(0, 16, 2)))))
    out["subset"] = [[x for b in loader for x in b.tolist()] for _ in range(2)]

    # A DistributedSampler of the user's: not sharded again, set_epoch called for us.
    from torch.utils.data.distributed import DistributedSampler
    ds = list(range(12))
    loader = acc.prepare(DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, shuffle=True)))
    out["distributed_sampler"] = [[x for b in loader for x in b.tolist()] for _ in range(2)]
    # Worker processes inside a rank.
    loader = acc.prepare(DataLoader(torch.arange(10), batch_size=3, num_workers=2))
    out["workers"] = torch.cat([acc.gather_for_metrics(b) for b in loader]).tolist()
    loader = acc.prepare(DataLoader(Sized(10), batch_size=3, num_workers=1))  # the shard runs in the worker
    out["workers_iterable"] = (torch.cat([acc.gather_for_metrics(b) for b in loader]).tolist())

    # gather_for_metrics over an uneven eval set (10 samples, 2 x 3 per round).
    eval_loader = acc.prepare(DataLoader(torch.arange(10), batch_size=3))
    gathered, flags = [], []
    for batch in eval_loader:
        flags.append(acc.gradient_state.end_of_dataloader)
        gathered.append(acc.gather_for_metrics(batch * 10))
    out["metrics"] = torch.cat(gathered).tolist()
    out["end_flags"] = flags
    out["metrics_objects"] = [x for b in eval_loader for x in acc.gather_for_metrics([f"s{i}" for i in b.tolist()])]
    out["metrics_dict"] = torch.cat([acc.gather_for_metrics({"x": b})["x"] for b in eval_loader]).tolist()
    # even_batches=False: different lengths, still the dataset exactly.
    acc_uneven = Accelerator(even_batches=False)
    uneven = acc_uneven.prepare(DataLoader(torch.arange(11), batch_size=3))
    out["metrics_uneven"] = torch.cat([acc_uneven.gather_for_metrics(b) for b in uneven]).tolist()
    # Iterable dataset, by default as in Accelerate: rank 0 reads each round and dispatches it.
    it = acc.prepare(DataLoader(Stream(10), batch_size=3))
    out["iterable"] = [b.tolist() for b in it]
    out["iterable_metrics"] = torch.cat([acc.gather_for_metrics(b) for b in it]).tolist()
    # dispatch_batches=False: each rank reads the stream and takes its slice of every round.
    acc_sharded = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    it = acc_sharded.prepare(DataLoader(Stream(10), batch_size=3))
    out["iterable_sharded"] = [b.tolist() for b in it]
    out["iterable_sharded_metrics"] = torch.cat([acc_sharded.gather_for_metrics(b) for b in it]).tolist()
    return out


class Sized(Stream):
    def __len__(self):
        return self.n


@pytest.fixture(scope="module")
def results(launch):
    return launch(_data_checks)


def test_tables_in_two_processes(results):
    r0, r1 = results
    assert r0["even"] == [[0, 1, 2], [6, 7, 8]] and r1["even"] == [[3, 4, 5], [9, 0, 1]]
    assert r0["uneven"] == [[0, 1, 2], [6, 7, 8]] and r1["uneven"] == [[3, 4, 5], [9]]
    assert r0["drop_last"] == [[0, 1, 2]] and r1["drop_last"] == [[3, 4, 5]]
    assert r0["split"] == [[0, 1], [4, 5], [8, 9]] and r1["split"] == [[2, 3], [6, 7], [0, 1]]
    assert r0["even_len"] == r1["even_len"] == 2 and r0["drop_last_len"] == 1


def test_shuffled_epochs_disjoint_complete_and_changing(results):
    r0, r1 = results
    for epoch in range(3):
        a, b = r0["shuffled"][epoch], r1["shuffled"][epoch]
        assert not set(a) & set(b)
        assert sorted(a + b) == list(range(20))
    assert r0["shuffled"][0] != r0["shuffled"][1] != r0["shuffled"][2]
    for epoch in range(2):
        a, b = r0["subset"][epoch], r1["subset"][epoch]
        assert not set(a) & set(b) and sorted(a + b) == list(range(0, 16, 2))
    assert r0["subset"][0] != r0["subset"][1]


def test_user_distributed_sampler_and_worker_processes(results):
    r0, r1 = results
    for epoch in range(2):
        a, b = r0["distributed_sampler"][epoch], r1["distributed_sampler"][epoch]
        assert not set(a) & set(b) and sorted(a + b) == list(range(12))
    assert r0["distributed_sampler"][0] != r0["distributed_sampler"][1]
    for r in results:
        assert r["workers"] == list(range(10))
        assert r["workers_iterable"] == list(range(10))


def test_gather_for_metrics_returns_exactly_the_dataset(results):
    for r in results:
        assert r["metrics"] == [10 * i for i in range(10)]
        assert r["end_flags"] == [False, True]
        assert r["metrics_objects"] == [f"s{i}" for i in range(10)]
        assert r["metrics_dict"] == list(range(10))
        assert r["metrics_uneven"] == list(range(11))
        assert r["iterable_metrics"] == r["iterable_sharded_metrics"] == list(range(10))
    # The last round [6, 7, 8, 9] is split evenly; sharded, rank 1 repeats the first samples.
    assert results[0]["iterable"] == [[0, 1, 2], [6, 7]]
    assert results[1]["iterable"] == [[3, 4, 5], [8, 9]]
    assert results[0]["iterable_sharded"] == [[0, 1, 2], [6, 7, 8]]
    assert results[1]["iterable_sharded"] == [[3, 4, 5], [9, 0, 1]]
