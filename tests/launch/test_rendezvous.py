"""The rendezvous store lives in the launcher, not in rank 0 (``nblaunch.launch.rendezvous``).

In rank 0 it died the moment rank 0 returned, and a peer still joining the group failed with
"Connection reset by peer": the first function people try (join, return the rank) failed now and
then. These tests fail deterministically where rank 0 hosts the store.
"""

from __future__ import annotations

import datetime
import os
import select
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from nblaunch import LaunchConfigError, notebook_launcher
from nblaunch.launch.handle import Launch
from nblaunch.launch.local_cluster import LocalCluster
from nblaunch.launch.planning import ports
from nblaunch.launch.planning.plan import plan_here
from nblaunch.launch.planning.request import LaunchRequest
from nblaunch.launch.rendezvous import Rendezvous


def _store_outlives_rank_0():
    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set("rank 0 pid", str(os.getpid()))
        return "left"
    pid = int(store.get("rank 0 pid"))
    pidfd = os.pidfd_open(pid)
    select.select([pidfd], [], [], 120)  # until rank 0's process is gone (120 s: a backstop)
    os.close(pidfd)
    store.set("after rank 0", "still here")
    return store.get("after rank 0").decode()


def test_the_store_outlives_rank_0():
    assert notebook_launcher(_store_outlives_rank_0, num_processes=2, display="none") == ["left", "still here"]


def _join_and_return():
    dist.init_process_group("gloo")
    return dist.get_rank()


def test_a_rank_that_returns_as_soon_as_it_joined_never_breaks_its_peers_join():
    # The race needs luck to show; the store barrier removes it, so every one of these passes.
    for _ in range(5):
        assert notebook_launcher(_join_and_return, num_processes=3, display="none") == [0, 1, 2]


def test_every_rank_is_the_stores_client_and_waits_for_every_group():
    environ = plan_here(LaunchRequest(_join_and_return, num_processes=2)).rank_environ(0)
    assert environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert environ["TORCH_DIST_INIT_BARRIER"] == "1"


def test_a_port_taken_after_it_was_chosen_is_a_clear_error():
    plan = plan_here(LaunchRequest(_join_and_return, num_processes=2))
    with socket.socket() as thief:
        thief.bind((plan.master_addr, plan.master_port))
        thief.listen()
        with pytest.raises(LaunchConfigError, match=rf"port {plan.master_port} is already in use.*use_port=None"):
            with Rendezvous(plan):
                pass


def test_a_free_port_taken_while_the_ranks_imports_were_made_is_chosen_again():
    # The imports before the fork may take seconds (one that hangs is waited for, then given up):
    # a free port chosen before them can be another program's by then.
    cluster = LocalCluster(LaunchRequest(_join_and_return, num_processes=2, display="none"))
    with socket.socket() as thief:
        thief.bind((cluster.plan.master_addr, cluster.plan.master_port))
        thief.listen()
        launch = Launch(cluster)
        assert launch.plan.master_port != thief.getsockname()[1]
        assert launch.run() == [0, 1]


def test_a_rank_that_connects_before_the_store_serves_is_served_once_it_does():
    # The ranks are forked before the store's thread starts (a rank forked while that thread held
    # glibc's resolver lock hung in its first connection); their connections wait in the backlog.
    plan = plan_here(LaunchRequest(_join_and_return, num_processes=2))
    with Rendezvous(plan) as rendezvous:
        client = []
        joining = threading.Thread(target=lambda: client.append(
            dist.TCPStore(plan.master_addr, plan.master_port, None, False, datetime.timedelta(seconds=60))))
        joining.start()
        joining.join(0.5)
        assert joining.is_alive() and not client  # connected, waiting for an answer
        rendezvous.serve()
        joining.join(60)
        client[0].set("key", "value")
        assert client[0].get("key") == b"value"
        del client[:]
    with pytest.raises(ConnectionRefusedError):  # gone with the attempt
        socket.create_connection((plan.master_addr, plan.master_port), timeout=30).close()


def _tutorial_setup(port: int, how: str):
    # As torch's DDP tutorial writes it: a meeting point of the code's own.
    if how == "env":
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", str(port)
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    dist.barrier()  # every rank done with rank 0's store before rank 0 leaves
    return float(t)


@pytest.mark.parametrize("how", ["env", "tcp"])
def test_code_that_names_its_own_meeting_point_meets_there(how):
    port = ports.choose_port("127.0.0.1", None, hosted_here=True)
    assert notebook_launcher(_tutorial_setup, args=(port, how), num_processes=2, display="none",
                             timeout=120) == [3.0, 3.0]
