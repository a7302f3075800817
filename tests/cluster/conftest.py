"""A real Ray cluster of two simulated nodes (each its own raylet, 2 CPUs), shared by the tests
of a module (and shut down after it, so the rest of the suite has the cores), and the check
that a launch leaves nothing of itself in Ray."""

from __future__ import annotations

import functools
import os
import socket
import types

import pytest

ray = pytest.importorskip("ray", reason="the Ray lane needs Ray: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    # A dashboard port of its own: Ray's default (8265) is taken by any other cluster on the machine
    # (another worker's, another run's), and without its dashboard a cluster has no state API.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "dashboard_port": _free_port()})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    # Pinned to this cluster and a namespace of its own: another Ray cluster on the machine (another
    # user's, another run of the suite) is never joined.
    ray.init(address=cluster.address, namespace=f"nblaunch-tests-{os.getpid()}", log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The state API is asked of the cluster by its address: left to itself it looks for "the" local
# cluster, and refuses where several run.
def live_actors(address: str) -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(address=address, limit=1000) if a.state != "DEAD"]


def live_placement_groups(address: str) -> list:
    from ray.util.state import list_placement_groups

    return [g for g in list_placement_groups(address=address, limit=1000) if g.state != "REMOVED"]


@pytest.fixture
def nothing_left_in_ray(ray_cluster):
    """After the test, once the nodes kept for a next launch are let go (``preloaded().release()``):
    no live actor and no placement group (Ray's state API says)."""
    yield
    import nblaunch

    nblaunch.preloaded().release()
    assert live_actors(ray_cluster.address) == [], "actors left behind"
    assert live_placement_groups(ray_cluster.address) == [], "placement groups left behind"


def agent_nodes(address: str) -> dict[int, str]:
    """{agent process id: its node's id}, for every agent Ray ever started."""
    from ray.util.state import list_actors

    return {a.pid: a.node_id for a in list_actors(address=address, limit=1000, detail=True) if a.class_name == "NodeAgent"}


@pytest.fixture
def ray_state(ray_cluster):
    """What Ray's state API lists now: ``.actors()``, ``.placement_groups()`` (live ones) and
    ``.agent_nodes()``."""
    address = ray_cluster.address
    return types.SimpleNamespace(actors=functools.partial(live_actors, address),
                                 placement_groups=functools.partial(live_placement_groups, address),
                                 agent_nodes=functools.partial(agent_nodes, address))
