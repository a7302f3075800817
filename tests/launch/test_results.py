"""Real launches that succeed: results, environment, ports, threads, repeated launches."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from nblaunch import debug_launcher, notebook_launcher
from nblaunch.events import LaunchStarted, RankFinished, RankState

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def report_rank(scale):
    """Join the gloo group, all-reduce, and return what this rank saw."""
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    seen = {name: os.environ[name] for name in RANK_VARIABLES}
    return {"env": seen, "sum": total.item(), "scaled": dist.get_rank() * scale, "threads": torch.get_num_threads()}


@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_every_rank_returns_its_result_in_rank_order(start_method, recorder):
    results = notebook_launcher(report_rank, args=(10,), num_processes=2, start_method=start_method, display=recorder)

    assert [r["scaled"] for r in results] == [0, 10]
    assert [r["sum"] for r in results] == [3.0, 3.0]  # a real all-reduce over gloo
    port = recorder.of(LaunchStarted)[0].master_port
    for rank, result in enumerate(results):
        assert result["env"] == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }
    assert [e.state for e in recorder.of(RankFinished)] == [RankState.DONE, RankState.DONE]
    for name in RANK_VARIABLES:
        assert name not in os.environ or name == "MASTER_ADDR" and os.environ[name] != "127.0.0.1"


def big_tensor():
    return torch.full((50 * 1024 * 1024 // 4,), float(os.environ["RANK"]))


def test_a_50_mb_result_comes_back_from_each_rank():
    first, second = notebook_launcher(big_tensor, num_processes=2, display="none")
    assert first.numel() * 4 == 50 * 1024 * 1024
    assert float(first[-1]) == 0.0 and float(second[-1]) == 1.0


def test_each_worker_gets_its_share_of_the_cores():
    threads = [r["threads"] for r in notebook_launcher(report_rank, args=(1,), num_processes=2, display="none")]
    assert threads == [max(1, len(os.sched_getaffinity(0)) // 2)] * 2


def test_the_user_choice_of_threads_is_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch_threads = torch.get_num_threads()
    # Forked, as asked: by default a launch after an earlier test's ranks imported a library that
    # reads OMP_NUM_THREADS (numpy's OpenBLAS) would start from the launch server, the variable
    # having changed since this process loaded the library for them (CI's floor lane).
    threads = [r["threads"] for r in notebook_launcher(report_rank, args=(1,), num_processes=2, display="none",
                                                       start_method="fork")]
    assert threads == [torch_threads] * 2  # inherited from this process, not changed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_pinned_free_port_is_used(recorder):
    port = free_port()
    results = notebook_launcher(report_rank, args=(1,), num_processes=2, use_port=str(port), display=recorder)
    assert {r["env"]["MASTER_PORT"] for r in results} == {str(port)}
    assert recorder.of(LaunchStarted)[0].master_port == port


def test_twenty_launches_in_a_row_in_one_process():
    for i in range(20):
        assert notebook_launcher(report_rank, args=(i,), num_processes=2, display="none")[1]["scaled"] == i


def one_rank(value):
    assert os.environ["WORLD_SIZE"] == "1"
    dist.init_process_group("gloo")
    return value * 2, os.getpid()


def test_one_process_runs_in_a_rank_of_its_own_and_leaves_no_state_here():
    [(value, pid)] = notebook_launcher(one_rank, args=(21,), num_processes=1)
    assert value == 42 and pid != os.getpid()
    assert not dist.is_initialized()
    assert notebook_launcher(report_rank, args=(1,), num_processes=2, display="none")[1]["sum"] == 3.0


def test_debug_launcher_gives_each_rank_its_own_rank():
    results = debug_launcher(report_rank, args=(1,), num_processes=2)
    assert [(r["env"]["RANK"], r["env"]["LOCAL_RANK"]) for r in results] == [("0", "0"), ("1", "1")]


def closure_factory(offset):
    def add(x):
        return x + offset + int(os.environ["RANK"])

    return add


@pytest.mark.slow
def test_closures_work_under_spawn():
    assert notebook_launcher(closure_factory(100), args=(1,), num_processes=2, start_method="spawn", display="none") == [101, 102]


FRESH_KERNEL = """
import os, sys
import nblaunch.training  # the launch will train: the launcher pre-imports torch._dynamo for its ranks
from nblaunch import notebook_launcher
print("imported at import", "torch._dynamo" in sys.modules)  # a second of CPU: not for an import

def rank_sees():
    import torch._dynamo  # already there, inherited through fork
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR")

# Whatever the import writes (torch 2.13: its inductor cache folder; torch 2.9: nothing), the ranks
# get the launch's compile cache (launch/planning/compile_cache).
from nblaunch.launch.planning.compile_cache import compile_cache_dir

before = dict(os.environ)
seen = notebook_launcher(rank_sees, num_processes=2, display="none")
print("unchanged", dict(os.environ) == before, "ranks got it", seen == [compile_cache_dir()] * 2,
      "imported", "torch._dynamo" in sys.modules)
"""


@pytest.mark.slow
def test_what_the_launcher_imports_for_its_ranks_does_not_change_the_kernels_environment():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FRESH_KERNEL], capture_output=True, text=True, timeout=120)
    assert "imported at import False" in done.stdout, done.stdout + done.stderr
    assert "unchanged True ranks got it True imported True" in done.stdout, done.stdout + done.stderr
