"""``block=False``: a handle at once, the launch going on in a thread that outlives the caller."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from nblaunch import RankFailedError, notebook_launcher
from nblaunch.events import RankState
from nblaunch.launch.errors import LaunchCancelledError


def wait_for_go(path):
    """Block until the test creates ``path`` (checked through the file system, not a sleep)."""
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} waiting", flush=True)
    while not os.path.exists(path):
        time.sleep(0.01)
    dist.barrier()
    return dist.get_rank()


def test_a_non_blocking_launch_returns_a_handle_and_later_its_results(tmp_path):
    go = tmp_path / "go"
    launch = notebook_launcher(wait_for_go, args=(str(go),), num_processes=2, display="none", block=False)
    assert not launch.done()
    deadline = time.monotonic() + 30
    while "waiting" not in launch.logs(1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert launch.status == "running"
    # Its repr stays in a saved cell: while it can change it says it is a moment's state.
    assert re.fullmatch(r"<Launch wait_for_go on 2 processes, made at \d\d:\d\d:\d\d: running when shown; "
                        r"\.status says now, \.result\(\) waits for the end>", repr(launch))
    assert "rank 1 waiting" in launch.logs(1)
    go.touch()
    assert launch.result(timeout=30) == [0, 1]
    assert launch.done() and launch.status == "done"
    assert repr(launch).endswith(": done>")
    assert launch.ranks == {0: RankState.DONE, 1: RankState.DONE}
    assert not launch.cancel()


def blocked():
    dist.init_process_group("gloo")
    print("blocked", flush=True)
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)
    else:
        time.sleep(600)


def test_cancel_collects_stacks_and_stops_every_rank(recorder):
    launch = notebook_launcher(blocked, num_processes=2, display=recorder, block=False)
    deadline = time.monotonic() + 30
    while not ("blocked" in launch.logs(0) and "blocked" in launch.logs(1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert launch.cancel()
    with pytest.raises(LaunchCancelledError):
        launch.result(timeout=30)
    assert launch.status == "cancelled"
    assert launch.ranks == {0: RankState.STOPPED, 1: RankState.STOPPED}
    assert "dist.recv" in launch.logs(0)  # the stack is in the rank's log on disk too


def fails():
    raise KeyError("missing")


def test_a_failure_is_raised_by_result():
    launch = notebook_launcher(fails, num_processes=2, display="none", block=False)
    with pytest.raises(RankFailedError, match="KeyError"):
        launch.result(timeout=30)
    assert launch.status == "failed"


def rank():
    return int(os.environ["RANK"])


def test_the_ranks_outlive_the_thread_that_asked_for_them():
    # PR_SET_PDEATHSIG fires when the forking thread exits: the launch must fork from its own thread.
    handles = []
    caller = threading.Thread(target=lambda: handles.append(notebook_launcher(wait_for_go_soon, num_processes=2, display="none", block=False)))
    caller.start()
    caller.join()
    assert handles[0].result(timeout=30) == [0, 1]


def wait_for_go_soon():
    dist.init_process_group("gloo")
    dist.barrier()  # both ranks alive after the calling thread has gone
    return dist.get_rank()


def test_one_process_without_blocking_runs_in_a_worker():
    launch = notebook_launcher(rank, num_processes=1, display="none", block=False)
    assert launch.result(timeout=30) == [0]
