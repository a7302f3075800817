"""What a cluster implements: the one seam between a launch and the processes it runs.

A *cluster* is where a launch's ranks live: this machine (``launch/local_cluster.LocalCluster``), the
nodes of a Ray cluster (``cluster/ray_cluster.RayCluster``). ``nblaunch.clusters`` picks one by the
request's ``cluster`` (its one reader); a new cluster is one module implementing
:class:`Cluster` and one line there. The :class:`~nblaunch.launch.handle.Launch` (display,
logs, restarts, the timeout budget, the ``block=False`` handle) is the same whatever the cluster.

Example (what a Launch does with its cluster)::

    cluster = LocalCluster(request)              # checked, planned; nothing started
    cluster.prepare(launch_id)                # on the caller's thread
    with cluster.attempt(cluster.plan, emit, time_left, log_dir) as watcher:
        results = watcher.run()               # every rank watched to its end
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, ContextManager, Protocol

from nblaunch.detached.kept_launch import KeptLaunch
from nblaunch.events import Event
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.planning.request import LaunchRequest
from nblaunch.launch.processes.packing import Payload


class RankWatcher(Protocol):
    """Watches one attempt's ranks to the end. ``cancel``, ``request_stacks`` and
    ``send_to_ranks`` are safe from any thread."""

    def run(self) -> list[Any]: ...

    def cancel(self, raising: BaseException | None = None) -> None: ...

    def request_stacks(self) -> None: ...

    def send_to_ranks(self, kind: bytes, body: bytes = b"", shared: Payload | None = None) -> None: ...


class Cluster(Protocol):
    """Where the ranks of a launch run."""

    # True: the cluster places every node's ranks itself (Ray); False: it runs this machine's ranks,
    # and each other node runs the same call (num_nodes, node_rank).
    starts_every_node: ClassVar[bool]
    # True: WarmRanks(detach=True) may keep warm ranks for it under a supervisor on this machine.
    detaches_warm_ranks: ClassVar[bool]
    plan: LaunchPlan  # made from the request when the cluster is made

    def __init__(self, request: LaunchRequest) -> None:
        """Check ``request`` for this cluster and make its ``plan``; nothing is started or placed.
        Raises LaunchConfigError, saying what to change."""

    def prepare(self, launch_id: str) -> None:
        """Called by each new launch on the caller's thread, before anything is shown; it may
        replace ``plan`` (its ``start_reason`` saying what was readied for the ranks)."""

    def shared_log_root(self) -> str | None:
        """Where the launch keeps its ranks' logs when they must be readable from other machines
        (a cluster's shared home directory); None: this machine's temporary folder."""

    def package(self, value: Any) -> Payload:
        """``value`` (a warm call) pickled for ranks that do not share this process's memory."""

    def attempt(self, plan: LaunchPlan, emit: Callable[[Event], None], time_left: float | None,
                log_dir: str) -> ContextManager[RankWatcher]:
        """Start every rank of ``plan`` (the cluster's plan, or a restart's); on leaving, nothing of
        the attempt is left running."""

    def keep(self) -> KeptLaunch:
        """``detach=True``: run the request under a keeper of its own, outside this process
        (a supervisor here, a detached actor on Ray), and return where it is kept."""

    @staticmethod
    def kept(kinds: tuple[str, ...]) -> list[KeptLaunch]:
        """The detached launches (``"launch"``) or warm ranks (``"pool"``) this kind of cluster
        keeps, oldest first: ``launches()`` and ``attach()`` look in every cluster."""
