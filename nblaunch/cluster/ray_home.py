"""``notebook_launcher(..., cluster="ray")``: the ranks live on the nodes of a Ray cluster.

Ray only places things: a placement group holds one bundle per node (every node or none), one
:class:`~nblaunch.cluster.agent.NodeAgent` actor sits in each bundle and runs nblaunch's own
launch of that node's ranks, and node 0's agent names the rendezvous (its address and a port
free there). Everything else (forking, lifelines, stacks, teardown, logs) is the local launch's,
on each node; :class:`~nblaunch.cluster.watcher.RayWatcher` merges the nodes' events into the
cell. After every attempt the agents are killed and the placement group removed.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from typing import Any, Callable, Iterator

import cloudpickle

import nblaunch
from nblaunch.cluster import placement
from nblaunch.cluster.agent import NodeAgent
from nblaunch.cluster.placement import NodeRequest
from nblaunch.cluster.watcher import RayWatcher
from nblaunch.events import Event, RanksPlaced
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.planning import pickling
from nblaunch.launch.planning.checks import check_basics, check_elastic_arguments, check_fp8, port_number, positive_int
from nblaunch.launch.planning.plan import CPU_RANKS_BY_DEFAULT, LaunchPlan, LaunchRequest, plural
from nblaunch.launch.starting.payload import Payload

_AGENT_CONCURRENCY = 8  # an agent answers a long-poll, a cancel and a stack request at once


def plan_ray_launch(request: LaunchRequest) -> tuple[LaunchPlan, "RayHome"]:
    """Check a Ray launch's arguments, then the cluster; nothing is placed yet."""
    r = request
    function, args, num_processes, start_method = r.function, r.args, r.num_processes, r.start_method
    mixed_precision = check_basics(function, args, r.mixed_precision, r.timeout, r.display)
    check_elastic_arguments(r)
    num_nodes = positive_int("num_nodes", r.num_nodes)
    if r.node_rank != 0 or r.master_addr != "127.0.0.1" or r.rdzv_endpoint not in ("", None):
        raise LaunchConfigError(
            "with cluster='ray', Ray places every node and node 0 hosts the rendezvous: leave node_rank, "
            "master_addr and rdzv_endpoint out (they are for running the same call on every machine yourself)"
        )
    if start_method not in (None, "fork", "spawn"):
        raise LaunchConfigError(f"with cluster='ray', start_method must be None, 'fork' or 'spawn'; got {start_method!r}")
    if r.max_restarts != 0:
        raise LaunchConfigError("max_restarts is not supported with cluster='ray' yet: pass max_restarts=0, or "
                                "resume from a checkpoint with a new launch")
    port = port_number(r.use_port)  # checked for use on node 0, by its agent
    # Nothing is asked of the cluster (not even a connection) for a launch that cannot run.
    pickling.check_picklable(function, args)
    ray, cluster = placement.connect()
    gpus = 0 if r.force_cpu else placement.gpus_per_node(ray, num_nodes)
    if num_processes is None:
        num_processes = gpus or CPU_RANKS_BY_DEFAULT
    num_processes = positive_int("num_processes", num_processes)
    check_fp8(mixed_precision, "cuda" if gpus else "cpu")
    request = NodeRequest(num_nodes=num_nodes, ranks=num_processes, gpus=1.0 if gpus else 0.0)
    placement.check_fits(ray, request)
    plan = LaunchPlan(
        function_name=r.function_name,
        num_processes=num_processes, num_nodes=num_nodes, node_rank=0, master_addr="node 0",
        master_port=port or 0, start_method="ray",
        start_reason=f"{plural(num_nodes, 'node')} of {cluster}, placed together by a Ray placement group; each "
                     "node's agent starts its ranks as a launch on one machine does",
        device_kind="cuda" if gpus else "cpu", threads=None, mixed_precision=mixed_precision, force_cpu=False,
        port_pinned=port is not None,
    )
    # A CPU launch stays on the CPU on every node, GPUs or not: Ray reserved none for it.
    node_options = dict(num_processes=num_processes, mixed_precision=mixed_precision, num_nodes=num_nodes,
                        start_method=start_method, force_cpu=not gpus)
    return plan, RayHome(ray, request, node_options)


class RayHome:
    """The ranks of a launch, one agent per Ray node (see the module's docstring)."""

    def __init__(self, ray: Any, request: NodeRequest, node_options: dict[str, Any]):
        self._ray = ray
        self._request = request
        self._node_options = node_options

    def prepare(self, plan: LaunchPlan, launch_id: str) -> None:
        pass  # each node's own launch prepares there

    def package(self, value: Any) -> Payload:
        return Payload(cloudpickle.dumps(value, protocol=5))  # Ray carries it; memfds stay on one machine

    def rank_count(self, plan: LaunchPlan) -> int:
        return plan.world_size

    def describe(self, plan: LaunchPlan) -> dict[str, Any]:
        return dict(num_processes=plan.world_size, meeting_point="node 0, once Ray has placed the ranks",
                    devices=f"{plan.devices}, {plural(plan.num_processes, 'rank')} "
                            f"on each of {plural(plan.num_nodes, 'Ray node')}")

    @contextlib.contextmanager
    def attempt(self, plan: LaunchPlan, function: Callable, args: tuple, emit: Callable[[Event], None],
                timeout: float | None, log_dir: str) -> Iterator[RayWatcher]:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        started = time.monotonic()  # the launch's timeout covers placing and starting too

        name = f"nblaunch-{uuid.uuid4().hex[:8]}"
        group = placement.reserve(ray, self._request, name)
        agents: list[Any] = []
        try:
            bundle = self._request.bundle
            agent_class = ray.remote(NodeAgent)
            for index in range(plan.num_nodes):
                agents.append(agent_class.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=_AGENT_CONCURRENCY,
                    name=f"{name}-node{index}",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                ).remote())
            where = self._where(agents, group)
            address, free_port, _ = where[0]
            port = plan.master_port if plan.port_pinned else free_port
            emit(RanksPlaced(tuple(w[0] for w in where), plan.num_processes, address, port))
            call = ray.put(cloudpickle.dumps((function, args)))
            starts = [
                agent.start.remote(call, dict(self._node_options, node_rank=index, master_addr=address,
                                              use_port=port), list(sys.path))
                for index, agent in enumerate(agents)
            ]
            self._get(starts, "could not start its ranks")
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
            yield RayWatcher(agents, plan.num_processes, emit, left)
        finally:
            placement.release(ray, agents, group)

    def _where(self, agents: list[Any], group: Any) -> list[tuple[str, int, str]]:
        """Each agent's address, free port and version, once Ray has placed and started them all."""
        asked = [agent.where.remote() for agent in agents]
        ready, _ = self._ray.wait(asked, num_returns=len(asked), timeout=placement.WAIT_FOR_PLACEMENT_S)
        if len(ready) < len(asked):
            if not placement.is_placed(self._ray, group):
                raise placement.unplaced_error(self._ray, self._request, placement.WAIT_FOR_PLACEMENT_S)
        where = self._get(asked, "did not start")
        for index, (address, _, version) in enumerate(where):
            if version != nblaunch.__version__:
                raise LaunchConfigError(f"node {index} ({address}) has nblaunch {version}, this notebook "
                                        f"{nblaunch.__version__}: install the same version on every node")
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
