"""The request and the cluster of a pool of warm ranks: checked when it is made, planned again for
each fresh start of its ranks (a fresh port).

Example::

    request = pool_request(2, "no", None, None, None, None, True, 60.0)
    cluster = pool_cluster(request)    # bad input refused here; nothing started
"""

from __future__ import annotations

from typing import Any, Sequence

from nblaunch.clusters import cluster_class, open_cluster
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.planning.request import LaunchRequest
from nblaunch.launch.cluster_interface import Cluster
from nblaunch.worker.calls import serve_calls


def pool_cluster(request: LaunchRequest) -> Cluster:
    """The cluster of a pool (planned again for each fresh pool: a fresh port)."""
    cluster = open_cluster(request)
    if cluster.plan.start_method == "xla":
        raise LaunchConfigError("warm ranks do not run on TPUs yet (torch_xla's xmp.spawn owns the "
                                "processes); use notebook_launcher, which starts them per call")
    return cluster


def pool_request(num_processes: Any, mixed_precision: Any, use_port: Any, start_method: Any, num_nodes: Any,
                  cluster: Any, cpu: Any, stall_after: Any) -> LaunchRequest:
    """The request of a pool: its ranks serve calls; each call has its own timeout and display."""
    request = LaunchRequest(serve_calls, (), num_processes, mixed_precision, use_port, num_nodes=num_nodes,
                            start_method=start_method, display="none", cpu=cpu, cluster=cluster,
                            stall_after=stall_after)
    if num_nodes not in (None, 1) and not cluster_class(request).starts_every_node:
        raise LaunchConfigError("warm ranks on several machines need a cluster to keep them: pass cluster='ray' or "
                                "cluster='slurm', "
                                f"or leave num_nodes out (got num_nodes={num_nodes!r})")
    return request


def checked_ranks(ranks: Sequence[int] | None, num_ranks: int) -> tuple[int, ...] | None:
    """``ranks`` as a call takes them (sorted, once each), or LaunchConfigError naming the valid ones."""
    if ranks is None:
        return None
    if isinstance(ranks, (str, bytes)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks) \
            or not ranks or any(not 0 <= r < num_ranks for r in ranks):
        raise LaunchConfigError(f"ranks must name ranks of this pool, 0 to {num_ranks - 1} ({num_ranks} ranks), "
                                f"got {ranks!r}")
    return tuple(sorted(set(ranks)))
