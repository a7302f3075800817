"""A real Ray cluster of two simulated nodes (each its own raylet, 2 CPUs), shared by the tests
of a module (and shut down after it, so the rest of the suite has the cores), and the check
that a launch leaves nothing of itself in Ray."""

from __future__ import annotations

import os
import types

import pytest

ray = pytest.importorskip("ray", reason="the Ray lane needs Ray: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
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


def live_actors() -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(limit=1000) if a.state != "DEAD"]


def live_placement_groups() -> list:
    from ray.util.state import list_placement_groups

    return [g for g in list_placement_groups(limit=1000) if g.state != "REMOVED"]


@pytest.fixture
def nothing_left_in_ray(ray_cluster):
    """After the test: no live actor and no placement group (Ray's state API says)."""
    yield
    assert live_actors() == [], "actors left behind"
    assert live_placement_groups() == [], "placement groups left behind"


def agent_nodes() -> dict[int, str]:
    """{agent process id: its node's id}, for every agent Ray ever started."""
    from ray.util.state import list_actors

    return {a.pid: a.node_id for a in list_actors(limit=1000, detail=True) if a.class_name == "NodeAgent"}


@pytest.fixture
def ray_state(ray_cluster):
    """What Ray's state API lists now: ``.actors()``, ``.placement_groups()`` (live ones) and
    ``.agent_nodes()``."""
    return types.SimpleNamespace(actors=live_actors, placement_groups=live_placement_groups, agent_nodes=agent_nodes)
