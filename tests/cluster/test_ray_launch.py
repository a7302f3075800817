"""notebook_launcher(..., num_nodes=2, cluster="ray") on a real two-node Ray cluster: 2 ranks
per node, gloo. Every test also checks that Ray lists no live actor or placement group after the
nodes kept for a next launch are let go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from nblaunch import LaunchConfigError, LaunchInterrupted, LaunchTimeoutError, RankFailedError, notebook_launcher
from nblaunch.events import RankFinished, RankState, Stacks

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("nothing_left_in_ray")]

RAY = dict(num_processes=2, num_nodes=2, cluster="ray")


def where_am_i(scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank() * scale, int(os.environ["LOCAL_RANK"]), os.getppid(), total.item()


def test_results_come_back_in_rank_order_from_both_nodes(recorder, ray_state):
    results = notebook_launcher(where_am_i, args=(10,), display=recorder, **RAY)

    assert [r[0] for r in results] == [0, 10, 20, 30]
    assert [r[1] for r in results] == [0, 1, 0, 1]
    assert {r[3] for r in results} == {6.0}  # 0+1+2+3: one process group over both nodes
    nodes = ray_state.agent_nodes()
    node_of_rank = [nodes[parent] for _, _, parent, _ in results]
    assert node_of_rank[0] == node_of_rank[1] != node_of_rank[2] == node_of_rank[3]
    assert [e.rank for e in recorder.of(RankFinished)] and all(
        e.state is RankState.DONE for e in recorder.of(RankFinished))


def agent_and_torch():
    return os.getppid(), "torch" in sys.modules


def test_the_next_launch_of_the_same_shape_takes_the_nodes_the_last_one_kept(ray_state):
    """The agents (and their placement group) stay between launches, torch loaded there; a launch
    of another shape lets them go first; preloaded().release() lets them go."""
    import nblaunch

    first = notebook_launcher(agent_and_torch, display="none", **RAY)
    assert len(ray_state.actors()) == 2 and len(ray_state.placement_groups()) == 1  # kept
    assert "kept on Ray: 2 nodes" in repr(nblaunch.preloaded())
    second = notebook_launcher(agent_and_torch, display="none", **RAY)
    assert [agent for agent, _ in second] == [agent for agent, _ in first]  # the same agents
    assert all(torch_there for _, torch_there in second)  # forked from agents that had it loaded
    other = notebook_launcher(agent_and_torch, display="none", num_processes=1, num_nodes=2, cluster="ray")
    assert not {agent for agent, _ in other} & {agent for agent, _ in first}  # another shape: new agents
    assert len(ray_state.placement_groups()) == 1  # the first shape's were let go
    assert nblaunch.preloaded().release() == 2
    assert ray_state.actors() == [] and ray_state.placement_groups() == []


def chatty():
    import sys

    rank = int(os.environ["RANK"])
    for i in range(300):
        print(f"line {i} of rank {rank}")
    print(f"to stderr from rank {rank}", file=sys.stderr)
    sys.stdout.flush()
    os.write(1, f"C-level from rank {rank}\n".encode())
    return rank


NOT_CONNECTED = """
import os, ray
from nblaunch import notebook_launcher

def rank():
    return int(os.environ["RANK"])

print("ranks", notebook_launcher(rank, num_processes=2, num_nodes=2, cluster="ray", display="text"), flush=True)
print("connected", ray.is_initialized(), flush=True)
"""


def test_a_process_not_connected_to_ray_is_told_which_cluster_nblaunch_joined(ray_cluster):
    # A fresh interpreter: this one stays connected as the suite pinned it (a process that Ray
    # was shut down in and connected again by nblaunch is no longer one the rest should fork from).
    pinned = dict(os.environ, RAY_ADDRESS=ray_cluster.address)  # never "the latest cluster on the machine"
    done = subprocess.run([sys.executable, "-c", NOT_CONNECTED], env=pinned, capture_output=True, text=True,
                          timeout=180)
    assert "ranks [0, 1, 2, 3]" in done.stdout and "connected True" in done.stdout, done.stdout + done.stderr
    line = next((l for l in done.stdout.splitlines() if l.startswith("nblaunch: rank on 4")), "")
    assert f"the Ray cluster at {ray_cluster.address} (2 nodes)" in line, done.stdout
    assert "joined by nblaunch with ray.init()" in line, done.stdout


def test_every_line_of_every_rank_arrives_tagged_with_its_rank(recorder):
    assert notebook_launcher(chatty, display=recorder, **RAY) == [0, 1, 2, 3]

    for rank in range(4):
        lines = recorder.lines(rank)
        assert [line for line in lines if line.startswith("line ")] == [f"line {i} of rank {rank}" for i in range(300)]
        assert f"C-level from rank {rank}" in lines
        assert recorder.lines(rank, "stderr") == [f"to stderr from rank {rank}"]


def raise_on_rank_3():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 3:
        raise ValueError("rank 3 is out of data")
    dist.barrier()  # the others wait here for rank 3, which never comes


def test_a_rank_raising_on_node_1_is_named_first_and_stops_every_node(recorder):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        notebook_launcher(raise_on_rank_3, display=recorder, **RAY)

    error = caught.value
    assert error.root_cause.rank == 3
    assert error.root_cause.reason == "ValueError: rank 3 is out of data"
    assert isinstance(error.__cause__, ValueError)
    assert "raise ValueError" in str(error.__cause__.__cause__)  # its traceback, chained
    assert str(error).startswith("rank 3 failed: ValueError: rank 3 is out of data")
    assert {e.rank for e in recorder.of(RankFinished)} == {0, 1, 2, 3}
    assert time.monotonic() - started < 30  # backstop: a hang would sit in the barrier forever


def kill_rank_2():
    import signal as signals

    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signals.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_sigkill_is_named(recorder):
    with pytest.raises(RankFailedError) as caught:
        notebook_launcher(kill_rank_2, display=recorder, **RAY)

    assert caught.value.root_cause.rank == 2
    assert "killed by SIGKILL" in caught.value.root_cause.reason


def wait_forever():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("ready", flush=True)
    while True:
        dist.barrier()
        time.sleep(0.05)


class InterruptWhenReady:
    """A display that sends SIGINT to this process once every rank has printed "ready"."""

    def __init__(self, recorder, num_ranks):
        self.recorder = recorder
        self.ready: set[int] = set()
        self.num_ranks = num_ranks

    def on_event(self, event):
        self.recorder.on_event(event)
        if getattr(event, "lines", None) and "ready" in event.lines:
            self.ready.add(event.rank)
            if len(self.ready) == self.num_ranks:
                os.kill(os.getpid(), signal.SIGINT)

    def close(self):
        pass


def test_an_interrupt_shows_every_ranks_stack_then_stops_every_node(recorder):
    assert threading.current_thread() is threading.main_thread()
    with pytest.raises(LaunchInterrupted):  # timeout: a lost interrupt fails the test, never hangs it
        notebook_launcher(wait_forever, display=InterruptWhenReady(recorder, 4), timeout=120, **RAY)

    stacks = {e.rank: e.text for e in recorder.of(Stacks)}
    assert sorted(stacks) == [0, 1, 2, 3]
    assert all("wait_forever" in text for text in stacks.values())
    assert {e.state for e in recorder.of(RankFinished)} == {RankState.STOPPED}


def test_a_timeout_stops_every_node_with_every_ranks_stack(recorder):
    with pytest.raises(LaunchTimeoutError) as caught:
        notebook_launcher(wait_forever, display=recorder, timeout=8, **RAY)

    assert sorted(caught.value.stacks) == [0, 1, 2, 3]
    assert all("in wait_forever" in text for text in caught.value.stacks.values()), caught.value.stacks
    assert "timeout=8" in str(caught.value)
    assert {e.state for e in recorder.of(RankFinished)} == {RankState.STOPPED}


def test_a_launch_needing_more_cpus_than_a_node_has_is_refused_before_anything_is_placed(ray_state):
    groups_before = len(ray_state.placement_groups())
    started = time.monotonic()
    with pytest.raises(LaunchConfigError, match=r"3 CPU each .*only 0 of the Ray cluster's 2 nodes"):
        notebook_launcher(where_am_i, args=(1,), num_processes=3, num_nodes=2, cluster="ray", display="none")
    with pytest.raises(LaunchConfigError, match=r"3 nodes .*only 2 of the Ray cluster's 2 nodes"):
        notebook_launcher(where_am_i, args=(1,), num_processes=2, num_nodes=3, cluster="ray", display="none")
    assert time.monotonic() - started < 2
    assert len(ray_state.placement_groups()) == groups_before


@pytest.mark.parametrize("bad, match", [
    (dict(args=[1]), "args must be a tuple"),
    (dict(args=()), "cannot be called with args"),
    (dict(cluster="dask"), "cluster must be None"),
    (dict(node_rank=1), "leave node_rank, master_addr and rdzv_endpoint out"),
    (dict(max_restarts=1), "max_restarts is not supported with cluster='ray'"),
    (dict(start_method="xla"), "start_method must be None, 'fork' or 'spawn'"),
])
def test_bad_input_is_refused_before_anything_is_placed(bad, match):
    options = dict(RAY, args=(1,), display="none")
    options.update(bad)
    with pytest.raises(LaunchConfigError, match=match):
        notebook_launcher(where_am_i, **options)


def test_a_launch_in_the_background_can_be_cancelled(recorder):
    launch = notebook_launcher(wait_forever, display=recorder, block=False, **RAY)
    while sum("ready" in line for r in range(4) for line in recorder.lines(r)) < 4:
        assert not launch.done(), launch.result()
        time.sleep(0.05)  # polling the display the launch feeds; a backstop below
    assert launch.cancel()
    with pytest.raises(Exception, match="cancelled"):
        launch.result(timeout=60)


def remember(value):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # the group lives on in the ranks, as the value does
    global kept  # lives on in the rank between calls
    kept = value * (dist.get_rank() + 1)
    return kept


def recall_and_reduce():
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(kept)])
    dist.all_reduce(total)
    return kept, total.item()


def test_warm_ranks_on_two_nodes_keep_their_state_between_calls(recorder):
    from nblaunch import WarmRanks

    with WarmRanks(num_processes=2, num_nodes=2, cluster="ray", display="none") as ranks:
        assert ranks.run(remember, 10) == [10, 20, 30, 40]
        started = time.monotonic()
        assert ranks.run(recall_and_reduce, display=recorder) == [(10, 100.0), (20, 100.0), (30, 100.0), (40, 100.0)]
        assert time.monotonic() - started < 5  # a call, not a launch (the benchmark has the figure)
        assert notebook_launcher(recall_and_reduce, ranks=ranks, display="none")[3] == (40, 100.0)
        assert repr(ranks) == "<WarmRanks: 4 processes, up>"
    with pytest.raises(LaunchConfigError, match="cluster='ray'"):
        WarmRanks(num_processes=2, num_nodes=2)


def report_agent_then_wait(pid_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    with open(os.path.join(pid_dir, f"{dist.get_rank()}-{os.getpid()}-{os.getppid()}"), "w"):
        pass
    while True:
        dist.barrier()
        time.sleep(0.05)


def test_a_node_whose_agent_dies_fails_its_ranks_and_stops_the_others(recorder, tmp_path):
    import psutil

    launch = notebook_launcher(report_agent_then_wait, args=(str(tmp_path),), display=recorder, block=False, **RAY)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.iterdir())) < 4:
        assert time.monotonic() < deadline and not launch.done()
        time.sleep(0.05)  # polling the files the ranks write; the deadline is the backstop
    ranks = {int(r): (int(pid), int(agent)) for r, pid, agent in (p.name.split("-") for p in tmp_path.iterdir())}
    node_1_agent = psutil.Process(ranks[2][1])
    node_1_agent.kill()
    with pytest.raises(RankFailedError) as caught:
        launch.result(timeout=60)

    assert caught.value.root_cause.rank in (2, 3)
    assert "agent was lost" in caught.value.root_cause.reason
    gone, alive = psutil.wait_procs([psutil.Process(pid) for pid, _ in ranks.values() if psutil.pid_exists(pid)], timeout=10)
    assert alive == []
