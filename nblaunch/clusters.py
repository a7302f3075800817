"""Which cluster a launch's ranks get: the one place ``cluster=`` is read.

``notebook_launcher``, ``WarmRanks``, ``nblaunch launch`` and ``launches()``/``attach()`` all
ask here. It sits above ``launch/`` and ``cluster/``, so a launch never depends on a cluster
engine. A new cluster is one module implementing ``launch/cluster_interface.Cluster`` and its entry in
:data:`CLUSTERS` (a function that imports it when first asked for).

Example::

    cluster = open_cluster(LaunchRequest(train, num_processes=2))   # this machine: checked, planned
    Launch(cluster).run()
"""

from __future__ import annotations

from typing import Callable

from nblaunch.detached.kept_launch import KeptLaunch
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.local_cluster import LocalCluster
from nblaunch.launch.planning.request import LaunchRequest
from nblaunch.launch.cluster_interface import Cluster


def _ray_home() -> type[Cluster]:
    # Deferred: a cluster's class is loaded when a launch asks for it (``import nblaunch`` stays
    # lean: its modules cost about 15 ms); Ray itself only when the cluster is made.
    from nblaunch.cluster.ray_cluster import RayCluster

    return RayCluster


def _slurm_home() -> type[Cluster]:
    from nblaunch.cluster.slurm_cluster import SlurmCluster  # deferred, as ``RayCluster``

    return SlurmCluster


# Every cluster, by the name cluster= gives it (None: this machine), loaded on first use.
CLUSTERS: dict[str | None, Callable[[], type[Cluster]]] = {
    None: lambda: LocalCluster,
    "ray": _ray_home,
    "slurm": _slurm_home,
}


def cluster_class(request: LaunchRequest) -> type[Cluster]:
    """The cluster ``request.cluster`` names (what it can do is asked of the class before any is made)."""
    if request.cluster not in CLUSTERS:
        names = ", ".join(repr(name) for name in CLUSTERS if name is not None)
        raise LaunchConfigError(f"cluster must be None (this machine) or one of {names}, got "
                                f"{request.cluster!r}")
    return CLUSTERS[request.cluster]()


def open_cluster(request: LaunchRequest) -> Cluster:
    """The cluster of ``request``: checked for it and planned, nothing started or placed yet.
    Raises LaunchConfigError."""
    return cluster_class(request)(request)


def all_kept(kinds: tuple[str, ...] = ("launch",)) -> list[KeptLaunch]:
    """This user's detached launches (of ``kinds``) in every cluster: those kept on this machine,
    then those kept by a cluster this process is connected to."""
    return [place for cluster in CLUSTERS.values() for place in cluster().kept(kinds)]
