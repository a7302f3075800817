"""Big arguments of warm calls travel as a spawn launch's do: memfds mapped copy-on-write."""

from __future__ import annotations

import os
import pickle

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

from nblaunch import RankFailedError, wire
from nblaunch.launch.processes import fdtable, packing
from nblaunch.warm.ranks import WarmRanks


def edit_in_place(tensor, view, array):
    """Rank 0 writes into its arguments; every rank then says what it sees."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        tensor += 1  # also through the view: they are one memory
        array += 1
    dist.barrier()  # rank 0 has written: rank 1 must not see it
    return float(tensor.sum()), float(view[0]), float(array.sum()), view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_a_big_argument_reaches_every_rank_as_its_own_copy(start_method):
    tensor = torch.zeros(1 << 20)  # 4 MiB: above the size that goes by memfd
    array = np.zeros(1 << 19)
    with WarmRanks(num_processes=2, start_method=start_method, display="none") as pool:
        for _ in range(2):  # the second call gets fresh copies, not the first call's edits
            results = pool.run(edit_in_place, tensor, tensor[5:], array)
            assert results == [(float(tensor.numel()), 1.0, float(array.size), True), (0.0, 0.0, 0.0, True)]
    assert float(tensor.sum()) == 0.0 and float(array.sum()) == 0.0, "the notebook's data changed"


def total_of_all(tensors):
    return float(sum(float(t.sum()) for t in tensors))


def test_more_memfds_than_one_message_can_carry_arrive_whole():
    # 256 go by memfd (the cap), more than the kernel's 253 per message; the rest in the pickle.
    tensors = [torch.full((1 << 18,), float(i)) for i in range(260)]  # 1 MiB each
    packed = packing.package(tensors)
    try:
        assert len(packed.fds) == 256
    finally:
        fdtable.close(packed.fds)
    expected = float(sum(i * (1 << 18) for i in range(260)))
    with WarmRanks(num_processes=2, display="none") as pool:
        assert pool.run(total_of_all, tensors) == [expected, expected]


def open_fds_and_rss(tensor) -> tuple[int, int]:
    float(tensor[::1024].sum())  # one float in every 4 KiB page: every page is read in
    return len(os.listdir("/proc/self/fd")), psutil.Process().memory_info().rss


def test_calls_with_big_arguments_leave_no_descriptors_or_memory_behind():
    tensor = torch.ones(10 << 20)  # 40 MiB
    here = psutil.Process()
    with WarmRanks(num_processes=2, display="none") as pool:
        for _ in range(3):
            pool.run(open_fds_and_rss, tensor)
        launcher_fds = here.num_fds()
        before = pool.run(open_fds_and_rss, tensor)
        for _ in range(30):
            after = pool.run(open_fds_and_rss, tensor)
        assert here.num_fds() == launcher_fds
        assert [fds for fds, _ in after] == [fds for fds, _ in before]
        grown = [b - a for (_, a), (_, b) in zip(before, after)]
        assert all(g < 8 * 2**20 for g in grown), grown  # 30 x 40 MiB would show


def test_a_call_whose_memfds_went_missing_fails_loudly_instead_of_hanging():
    with WarmRanks(num_processes=2, display="none") as pool:
        pool.run(os.getpid)
        # A SHARED frame announcing a memfd that never came: the rank's control thread cannot
        # go on, and must say so rather than leave the next call waiting forever.
        pool._launch.send(wire.SHARED, pickle.dumps(([999], [])))
        with pytest.raises(RankFailedError, match="control thread"):
            pool._launch.result(timeout=60)  # the ranks end now, between calls
        # The next call raises that failure (nobody saw it yet); the one after starts afresh.
        with pytest.raises(RankFailedError, match="control thread"):
            pool.run(os.getpid)
        assert len(set(pool.run(os.getpid))) == 2
