"""Spawned ranks get big tensor arguments through shared memory, not through the payload."""

from __future__ import annotations

import os

import pytest
import torch

from nblaunch import notebook_launcher
from nblaunch.launch import pickling

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux shared memory")


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _describe(big, small):
    import os

    from nblaunch.worker.bootstrap import __name__ as _  # noqa: F401  (the rank is a spawned nblaunch worker)

    return {
        "rank": int(os.environ["RANK"]),
        "shared": big.is_shared(),
        "sum": float(big.sum()),
        "first": big[:3].tolist(),
        "view_sum": float(big[1000:1010].sum()),
        "small": small.tolist(),
    }


def test_spawned_ranks_see_the_same_tensor_through_shared_memory():
    before = _shm_entries()
    big = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB: shared
    small = torch.tensor([1.0, 2.0, 3.0])  # a few bytes: pickled as usual
    results = notebook_launcher(_describe, args=(big, small), num_processes=2, start_method="spawn", display="none")
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["shared"], "the worker's tensor is a copy, not the shared pages"
        assert r["sum"] == float(big.sum())
        assert r["first"] == [0.0, 1.0, 2.0]
        assert r["view_sum"] == float(big[1000:1010].sum())
        assert r["small"] == [1.0, 2.0, 3.0]
    assert torch.equal(big, torch.arange(1 << 19, dtype=torch.float32)), "the launcher's tensor changed"
    assert _shm_entries() <= before, f"left in /dev/shm: {_shm_entries() - before}"


def test_payload_carries_a_reference_not_the_bytes():
    big = torch.zeros(1 << 20)  # 4 MiB
    packed = pickling.package(len, (big,))
    assert len(packed) < 64 * 1024
    assert len(pickling.package(len, (torch.zeros(16),))) < 64 * 1024
