"""Detached warm ranks survive a kernel killed hard: the next kernel's first ``%%distributed``
cell reattaches to the same ranks, a tensor still in their namespace; ``WarmRanks.attach()``
finds them from Python; closing them leaves nothing."""

from __future__ import annotations

import os
import re

import psutil
import pytest

from nblaunch import WarmRanks
from processes import stop_every_launch_in
from test_detached_kernels import Kernel, _state

CELL = "%%distributed -n 2 --detach\nimport os, torch\nkept = torch.full((2,), float(os.environ['RANK']))\nos.getpid()"


@pytest.fixture
def state_dir(tmp_path):
    folder = str(tmp_path / "state")
    yield folder
    stop_every_launch_in(folder)


@pytest.mark.slow
def test_warm_ranks_and_their_tensor_outlive_the_kernel(state_dir):
    first = Kernel(state_dir)
    try:
        first.run("%load_ext nblaunch")
        shown = first.run(CELL)
    finally:
        first.kill()
    pids = [int(p) for p in re.findall(r"\d+", shown.strip().splitlines()[-1])]
    assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids), shown

    second = Kernel(state_dir)
    try:
        second.run("%load_ext nblaunch")
        shown = second.run("%%distributed --detach\nkept.tolist(), os.getpid()")
        (pool_id,) = re.findall(r"reattached to the detached warm ranks (\w+) \(2 processes\)", shown)
        assert f"[([0.0, 0.0], {pids[0]}), ([1.0, 1.0], {pids[1]})]" in shown, shown
        supervisor = _state(state_dir, pool_id)["supervisor_pid"]
        assert "no warm ranks yet" in second.run("%distributed stop\n%distributed status")
    finally:
        second.close()
    _, alive = psutil.wait_procs([psutil.Process(p) for p in [*pids, supervisor] if psutil.pid_exists(p)], timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def _rank_and_pid():
    import os

    return int(os.environ["RANK"]), os.getpid()


def test_attach_finds_the_same_ranks_and_bad_input_is_refused_before_anything_starts(state_dir, monkeypatch):
    monkeypatch.setenv("NBLAUNCH_STATE_DIR", state_dir)
    with pytest.raises(LookupError, match=r"no detached warm ranks of this user are up: WarmRanks\(..., detach=True\)"):
        WarmRanks.attach()
    with pytest.raises(Exception, match="num_processes"):
        WarmRanks(0, detach=True)
    assert not os.path.isdir(os.path.join(state_dir, "detached")) or not os.listdir(os.path.join(state_dir, "detached"))
    pool = WarmRanks(2, detach=True, display="none")
    first = pool.run(_rank_and_pid)
    again = WarmRanks.attach(pool.launch_id[:4], display="none")
    assert again.run(_rank_and_pid) == first and repr(again).endswith("processes, up; "
                                                                       f"WarmRanks.attach('{pool.launch_id}') from any kernel>")
    again.close()
    assert not pool.alive
    with pytest.raises(Exception, match="are closed; make a new WarmRanks"):
        pool.run(_rank_and_pid)
