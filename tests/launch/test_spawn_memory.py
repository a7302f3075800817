"""Spawned ranks get big arguments as fork gives them: each rank its own copy-on-write view of
the notebook's data, mapped from one copy of its bytes, never pickled per rank."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from nblaunch import notebook_launcher
from nblaunch.launch.processes import fdtable, packing

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux memfds")]


def _mapped_from_a_memfd(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return "memfd:nblaunch-argument" in line
    return False


def _describe(big, small, array):
    return {
        "rank": int(os.environ["RANK"]),
        "mapped": _mapped_from_a_memfd(big.data_ptr()) and _mapped_from_a_memfd(array.ctypes.data),
        "sum": float(big.sum()),
        "view_sum": float(big[1000:1010].sum()),
        "small": small.tolist(),
        "array_sum": float(array.sum()),
    }


def test_spawned_ranks_map_big_tensors_and_arrays_instead_of_unpickling_copies():
    big = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB: through a memfd
    small = torch.tensor([1.0, 2.0, 3.0])  # a few bytes: pickled as usual
    array = np.arange(1 << 18, dtype=np.float64)  # 2 MiB numpy: out of band, through a memfd
    results = notebook_launcher(_describe, args=(big, small, array), num_processes=2, start_method="spawn",
                                display="none")
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["mapped"], "the rank's data is a copy, not the launcher's pages"
        assert r["sum"] == float(big.sum()) and r["view_sum"] == float(big[1000:1010].sum())
        assert r["small"] == [1.0, 2.0, 3.0]
        assert r["array_sum"] == float(array.sum())


def _edit_in_place(tensor, array):
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        tensor.add_(1)
        array += 1
    dist.barrier()  # rank 0 has written: rank 1 must not see it
    return float(tensor.sum()), float(array.sum())


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_an_in_place_edit_in_one_rank_changes_nothing_elsewhere(start_method):
    tensor = torch.zeros(1 << 20)  # 4 MiB
    array = np.zeros(1 << 19)
    results = notebook_launcher(_edit_in_place, args=(tensor, array), num_processes=2,
                                start_method=start_method, display="none")
    n_tensor, n_array = tensor.numel(), array.size
    assert results == [(float(n_tensor), float(n_array)), (0.0, 0.0)]
    assert float(tensor.sum()) == 0.0 and float(array.sum()) == 0.0, "the notebook's data changed"


def _write_through_a_view(whole, view):
    view[0] = 7.0
    return float(whole[1])


def test_views_of_one_tensor_stay_views_of_one_tensor_in_a_spawned_rank():
    whole = torch.zeros(1 << 20)
    packed = packing.package((len, (whole, whole[1:], whole[2:])))
    try:
        assert len(packed.fds) == 1, "each view was copied on its own"
    finally:
        fdtable.close(packed.fds)
    results = notebook_launcher(_write_through_a_view, args=(whole, whole[1:]), num_processes=2,
                                start_method="spawn", display="none")
    assert results == [7.0, 7.0] and float(whole[1]) == 0.0


def test_the_payload_carries_references_not_the_bytes():
    packed = packing.package((len, (torch.zeros(1 << 20), np.zeros(1 << 18))))
    try:
        assert len(packed.data) < 64 * 1024 and len(packed.fds) == 2
    finally:
        fdtable.close(packed.fds)
    small = packing.package((len, (torch.zeros(16),)))
    assert small.fds == [] and len(small.data) < 64 * 1024


PEAK_SCRIPT = """
import resource, sys, numpy as np, torch
from nblaunch import notebook_launcher
data = np.ones(400 * 2**20 // 8)                      # 400 MB, captured by the function
def train():
    return float(data[:10].sum())
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert notebook_launcher(train, num_processes=2, start_method="spawn", display="none") == [10.0, 10.0]
print(baseline, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.slow
def test_a_spawned_launch_adds_no_copy_of_a_captured_array_to_the_launchers_peak_memory():
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    baseline_kb, peak_kb = map(int, done.stdout.split())
    # Pickled as it was, the array cost about 3 more copies here at the peak (1.2 GB).
    assert peak_kb - baseline_kb < 100 * 1024, f"the launch added {(peak_kb - baseline_kb) // 1024} MB"
