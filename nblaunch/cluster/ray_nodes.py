"""The nodes of a Ray launch, kept for the next one: a placement group (one bundle per node, all
or none) and one :class:`~nblaunch.cluster.agent.NodeAgent` in each bundle. Placing them costs
seconds (Ray starts a process per agent, which imports torch); an agent forks its node's ranks
as this machine forks them, importing first what they will import (``launch/starting/preload``),
so a kept agent already has what earlier ranks imported.

A launch on the same cluster with the same shape (nodes, ranks per node, GPUs) takes the kept
ones (each launch asks node 0's agent for a free port again); one of another shape lets them go
first. They are given back only when the launch saw every node's launch end (an agent lost, or a
launch left running by an interrupt, is let go). They hold their bundles' CPUs and GPUs while
kept, and end with this process (Ray ends a driver's actors and placement groups with it), when
the cluster goes, or with ``nblaunch.preloaded().release()``.

Example::

    nodes = kept_nodes().take(ray, NodeRequest(num_nodes=2, ranks=2))   # kept, or placed now
    ...                                                                  # a launch on nodes.agents
    kept_nodes().give_back(ray, nodes, usable=True)                      # for the next launch
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from typing import Any

from nblaunch.cluster import ray_placement
from nblaunch.cluster.agent import NodeAgent
from nblaunch.cluster.ray_placement import NodeRequest
from nblaunch.per_process import per_process

_AGENT_CONCURRENCY = 8  # an agent answers a long-poll, a cancel and a stack request at once


@dataclasses.dataclass(eq=False)
class Nodes:
    """One placement group and its agents (node k's in bundle k)."""

    address: str  # the cluster's (its GCS address)
    request: NodeRequest
    group: Any
    agents: list[Any]
    kept: bool = False  # taken from the kept ones (its agents may have died meanwhile)


class KeptNodes:
    """This process's kept nodes (see the module). Thread-safe: a launch takes them whole, and
    a concurrent launch of the same shape places its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[Nodes] = []
        self._ray: Any = None

    def take(self, ray: Any, request: NodeRequest) -> Nodes:
        """The kept nodes of ``request``'s shape on this cluster, or new ones (placed now: the
        agents start as soon as Ray has placed the group)."""
        address = ray.get_runtime_context().gcs_address
        with self._lock:
            self._ray = ray
            mine = [n for n in self._kept if (n.address, n.request) == (address, request)]
            others, self._kept = [n for n in self._kept if n not in mine], []
        for nodes in others:  # another shape: what they hold is this launch's to have
            if nodes.address == address:
                release(ray, nodes)  # (another cluster's ended with the session that joined it)
        if mine:
            return dataclasses.replace(mine[0], kept=True)
        return place(ray, request, address)

    def give_back(self, ray: Any, nodes: Nodes, usable: bool) -> None:
        """Keep ``nodes`` for the next launch if ``usable`` (and none of its shape is kept yet:
        two launches at once each placed their own), else let them go."""
        with self._lock:
            keep = usable and not any((n.address, n.request) == (nodes.address, nodes.request) for n in self._kept)
            if keep:
                self._kept.append(dataclasses.replace(nodes, kept=False))
        if not keep:
            release(ray, nodes)

    def held(self) -> list[Nodes]:
        with self._lock:
            return list(self._kept)

    def release_all(self) -> int:
        """Let every kept node go; how many agents there were (those of a cluster this process
        is no longer connected to ended with that connection)."""
        with self._lock:
            kept, self._kept = self._kept, []
        ray = self._ray
        address = ray.get_runtime_context().gcs_address if ray is not None and ray.is_initialized() else None
        for nodes in kept:
            if nodes.address == address:
                release(ray, nodes)
        return sum(len(n.agents) for n in kept)


kept_nodes = per_process(KeptNodes)


def place(ray: Any, request: NodeRequest, address: str) -> Nodes:
    """A new placement group for ``request`` and one agent in each of its bundles."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # deferred: Ray's, loaded with it

    name = f"nblaunch-{uuid.uuid4().hex[:8]}"
    group = ray_placement.reserve(ray, request, name)
    agents: list[Any] = []
    try:
        bundle = request.bundle
        agent_class = ray.remote(NodeAgent)
        for index in range(request.num_nodes):
            agents.append(agent_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=_AGENT_CONCURRENCY,
                name=f"{name}-node{index}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            ).remote())
    except BaseException:
        ray_placement.release(ray, agents, group)
        raise
    return Nodes(address, request, group, agents)


def release(ray: Any, nodes: Nodes) -> None:
    """Kill the agents (their ranks die with them) and remove the placement group."""
    try:
        ray_placement.release(ray, nodes.agents, nodes.group)
    except Exception:  # noqa: BLE001  the cluster is gone already: nothing of ours is left on it
        pass
