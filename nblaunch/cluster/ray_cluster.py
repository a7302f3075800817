"""``notebook_launcher(..., cluster="ray")``: the ranks live on the nodes of a Ray cluster (a
cluster: ``launch/cluster_interface.Cluster``).

Ray only places things: a placement group holds one bundle per node (every node or none), one
:class:`~nblaunch.cluster.agent.NodeAgent` actor sits in each bundle and runs nblaunch's own
launch of that node's ranks, and node 0's agent names the rendezvous (its address and a port
free there). Everything else (forking, lifelines, stacks, teardown, logs) is the local launch's,
on each node; :class:`~nblaunch.cluster.watcher.NodesWatcher` merges the nodes' events into the
cell. The group and its agents are kept for the next launch of the same shape (``ray_nodes``).
A detached launch is kept by an actor of the cluster (``ray_keeper``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable, ClassVar, Iterator

import cloudpickle

from nblaunch.cluster import ray_nodes, ray_placement
from nblaunch.cluster.agent import NodePlace, check_cluster_request
from nblaunch.cluster.ray_keeper import kept_on_ray, start_on_ray
from nblaunch.cluster.ray_links import RayLinks
from nblaunch.cluster.ray_nodes import kept_nodes
from nblaunch.cluster.ray_placement import NodeRequest
from nblaunch.cluster.watcher import NodesWatcher
from nblaunch.contract.version import __version__
from nblaunch.detached.kept_launch import KeptLaunch
from nblaunch.events import Event, RanksPlaced
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.planning import pickling
from nblaunch.launch.planning.plan import (
    LaunchPlan,
    check_fp8,
    decided_precision,
    plural,
    ranks_per_node,
)
from nblaunch.launch.planning.request import LaunchRequest
from nblaunch.launch.processes.packing import Payload

class RayCluster:
    """The ranks of a launch, one agent per Ray node (see the module's docstring)."""

    starts_every_node: ClassVar[bool] = True
    detaches_warm_ranks: ClassVar[bool] = False  # a detached actor keeps launches; warm ranks not yet

    def __init__(self, request: LaunchRequest) -> None:
        """Check a Ray launch's request, then the cluster; nothing is placed yet."""
        r = request
        check_cluster_request(r, "ray", "Ray places",
                              " (they are for running the same call on every machine yourself)")
        if r.resources:
            raise LaunchConfigError("resources= is for cluster='slurm': a Ray cluster's nodes are placed by "
                                    "num_nodes and num_processes (and the GPUs each node has)")
        # Nothing is asked of the cluster (not even a connection) for a launch that cannot run.
        pickling.check_picklable(r.function, r.args)
        self._ray, cluster = ray_placement.connect()
        num_nodes = r.num_nodes or 1
        gpus = 0 if r.cpu else ray_placement.gpus_per_node(self._ray, num_nodes)
        num_processes = ranks_per_node(r, gpus)
        # "auto" is decided on each node, by its own GPUs; here it reads as the CPU's where there are none.
        precision = r.mixed_precision if gpus else decided_precision(r.mixed_precision, "cpu", None)
        check_fp8(precision, "cuda" if gpus else "cpu")
        self._nodes = NodeRequest(num_nodes=num_nodes, ranks=num_processes, gpus=1.0 if gpus else 0.0)
        ray_placement.check_fits(self._ray, self._nodes)
        kind = plural(num_processes, "CUDA GPU") if gpus else "CPU"
        self.plan = LaunchPlan(
            request=r, num_processes=num_processes, num_nodes=num_nodes, node_rank=0, master_addr="node 0",
            master_port=r.use_port or 0, start_method="ray",
            start_reason=f"{plural(num_nodes, 'node')} of {cluster}, placed together by a Ray placement group; "
                         "each node's agent starts its ranks as a launch on one machine does",
            device_kind="cuda" if gpus else "cpu",
            devices=f"{kind}, {plural(num_processes, 'rank')} on each of {plural(num_nodes, 'Ray node')}",
            shown_ranks=num_processes * num_nodes, precision=precision,
            meeting_point="node 0, once Ray has placed the ranks",
            port_pinned=r.use_port is not None,
        )
        # What each node's agent launches there: its share, the driver keeping the clock. A CPU
        # launch stays on the CPU on every node, GPUs or not: Ray reserved none for it.
        self._node_request = dataclasses.replace(r, cluster=None, num_processes=num_processes, cpu=not gpus,
                                                 timeout=None, display="none")

    def prepare(self, launch_id: str) -> None:
        pass  # each node's own launch prepares there

    def shared_log_root(self) -> str | None:
        return None  # the driver's machine; each node keeps its own too

    def package(self, value: Any) -> Payload:
        return Payload(cloudpickle.dumps(value, protocol=5))  # Ray carries it; memfds stay on one machine

    @contextlib.contextmanager
    def attempt(self, plan: LaunchPlan, emit: Callable[[Event], None], time_left: float | None,
                log_dir: str) -> Iterator[NodesWatcher]:
        ray = self._ray
        started = time.monotonic()  # the launch's timeout covers placing and starting too
        nodes = kept_nodes().take(ray, self._nodes)
        watcher: NodesWatcher | None = None
        try:
            try:
                where = self._where(nodes.agents, nodes.group)
            except LaunchConfigError:
                if not nodes.kept:
                    raise
                # A kept agent died since the last launch (its node went, Ray lost it): place anew.
                ray_nodes.release(ray, nodes)
                nodes = ray_nodes.place(ray, self._nodes, nodes.address)
                where = self._where(nodes.agents, nodes.group)
            address, free_port, _ = where[0]
            port = plan.master_port if plan.port_pinned else free_port
            emit(RanksPlaced(tuple(w[0] for w in where), plan.num_processes, address, port))
            node_request = ray.put(cloudpickle.dumps(self._node_request))  # the function and its arguments, once
            starts = [agent.start.remote(node_request, NodePlace(index, address, port), list(sys.path))
                      for index, agent in enumerate(nodes.agents)]
            self._get(starts, "could not start its ranks")
            left = None if time_left is None else max(0.0, time_left - (time.monotonic() - started))
            watcher = NodesWatcher(RayLinks(ray, nodes.agents), plan.num_nodes, plan.num_processes, emit, left)
            yield watcher
        finally:
            # Kept for the next launch only where every node's launch was seen to end.
            kept_nodes().give_back(ray, nodes, usable=watcher is not None and watcher.every_node_ended)

    def keep(self) -> KeptLaunch:
        return start_on_ray(type(self), self.plan.request, self.plan.world_size)

    @staticmethod
    def kept(kinds: tuple[str, ...]) -> list[KeptLaunch]:
        ray = sys.modules.get("ray")  # Ray is never loaded or joined to look
        if "launch" not in kinds or ray is None or not ray.is_initialized():
            return []
        return kept_on_ray()

    def _where(self, agents: list[Any], group: Any) -> list[tuple[str, int, str]]:
        """Each agent's address, free port and version, once Ray has placed and started them all."""
        asked = [agent.where.remote() for agent in agents]
        ready, _ = self._ray.wait(asked, num_returns=len(asked), timeout=ray_placement.WAIT_FOR_PLACEMENT_S)
        if len(ready) < len(asked):
            if not ray_placement.is_placed(self._ray, group):
                raise ray_placement.unplaced_error(self._ray, self._nodes, ray_placement.WAIT_FOR_PLACEMENT_S)
        where = self._get(asked, "did not start")
        for index, (address, _, version) in enumerate(where):
            if version != __version__:
                raise LaunchConfigError(f"node {index} ({address}) has nblaunch {version}, this notebook "
                                        f"{__version__}: install the same version on every node")
        return where

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        """``ray.get``, with an agent's failure said as what the user must change."""
        try:
            return self._ray.get(refs)
        except Exception as error:
            cause = getattr(error, "cause", None) or error
            text = str(cause).strip().splitlines()
            detail = text[-1] if text else type(cause).__name__
            hint = ""
            if "No module named 'nblaunch'" in str(error):
                hint = " Install nblaunch (pip install 'nblaunch[ray]') on every node of the cluster."
            if isinstance(cause, LaunchConfigError):
                raise LaunchConfigError(f"a node refused the launch: {cause}") from None
            raise LaunchConfigError(f"nblaunch's agent on a Ray node {what}: {detail}.{hint}") from None
