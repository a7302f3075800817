"""Asking Ray for a launch's nodes: connecting, checking that the cluster can hold the ranks,
and gang-scheduling them (one placement group bundle per node: all nodes or none).

Ray is imported here, and only when ``cluster="ray"`` is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nblaunch.launch.errors import LaunchConfigError

WAIT_FOR_PLACEMENT_S = 30.0  # a cluster that could hold the launch but is busy: wait this long, then say so


@dataclass(frozen=True)
class NodeRequest:
    """What each node of a launch must have: ``ranks`` ranks, each with ``cpus`` CPUs and ``gpus`` GPUs."""

    num_nodes: int
    ranks: int
    cpus: float = 1.0
    gpus: float = 0.0

    @property
    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.ranks * self.cpus}
        if self.gpus:
            bundle["GPU"] = self.ranks * self.gpus
        return bundle

    def describe(self) -> str:
        each = f"{self.cpus:g} CPU" + (f" and {self.gpus:g} GPU" if self.gpus else "")
        return (f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''} with "
                + " and ".join(f"{amount:g} {name}" for name, amount in self.bundle.items())
                + f" each ({self.ranks} rank{'s' if self.ranks != 1 else ''} per node, {each} per rank)")


def connect() -> tuple[Any, str]:
    """The ``ray`` module, connected to a cluster (Ray's defaults if this process is not yet),
    and which cluster that is, in words for the launch line."""
    try:
        import ray
    except ImportError:
        raise LaunchConfigError(
            "cluster='ray' needs Ray in this environment: pip install 'nblaunch[ray]' (and nblaunch on every "
            "node of the cluster)"
        ) from None
    connected_by_us = not ray.is_initialized()
    if connected_by_us:
        try:
            ray.init()  # RAY_ADDRESS, or the cluster running on this machine, or a new local one
        except Exception as error:
            raise LaunchConfigError(
                f"could not connect to a Ray cluster ({type(error).__name__}: {error}). Start one (ray start "
                "--head) or connect first: ray.init(address='auto' or 'ray://head:10001')"
            ) from None
    address = ray.get_runtime_context().gcs_address
    nodes = len(alive_nodes(ray))
    which = f"the Ray cluster at {address} ({nodes} node{'s' if nodes != 1 else ''})"
    if connected_by_us:
        which += (", joined by nblaunch with ray.init() since this process was not connected: to choose, "
                  "call ray.init(address=...) first")
    return ray, which


def alive_nodes(ray: Any) -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def gpus_per_node(ray: Any, num_nodes: int) -> int:
    """GPUs each of ``num_nodes`` nodes can give (the fewest among the nodes that have most),
    0 if fewer than ``num_nodes`` nodes have a GPU. A CPU-only head node does not count."""
    counts = sorted((int(node["Resources"].get("GPU", 0)) for node in alive_nodes(ray)), reverse=True)
    return counts[num_nodes - 1] if len(counts) >= num_nodes else 0


def check_fits(ray: Any, request: NodeRequest) -> None:
    """Refuse, before anything is placed, a launch that the cluster's nodes could never hold."""
    nodes = alive_nodes(ray)
    fitting = [n for n in nodes if all(n["Resources"].get(name, 0) >= amount for name, amount in request.bundle.items())]
    if len(fitting) >= request.num_nodes:
        return
    have = "; ".join(
        f"{n['NodeManagerAddress']} ({n['NodeID'][:8]}): "
        + ", ".join(f"{n['Resources'].get(name, 0):g} {name}" for name in request.bundle)
        for n in nodes
    ) or "no live node"
    raise LaunchConfigError(
        f"the launch needs {request.describe()}, but only {len(fitting)} of the Ray cluster's "
        f"{len(nodes)} nodes can hold that: {have}. Use fewer ranks per node (num_processes) or fewer nodes "
        "(num_nodes), or add nodes to the cluster."
    )


def reserve(ray: Any, request: NodeRequest, name: str) -> Any:
    """A placement group with one bundle per node, on distinct nodes. Not waited for: the
    agents are created into it at once and start as soon as Ray has placed it."""
    from ray.util.placement_group import placement_group

    strategy = "STRICT_SPREAD" if request.num_nodes > 1 else "STRICT_PACK"
    return placement_group([request.bundle] * request.num_nodes, strategy=strategy, name=name)


def unplaced_error(ray: Any, request: NodeRequest, waited_s: float) -> LaunchConfigError:
    """What to say when the group was not placed in time: the cluster could hold it, but
    other work holds what it needs."""
    free = "; ".join(
        f"{node_id[:8]}: " + ", ".join(f"{amount:g} {name} free" for name, amount in sorted(res.items())
                                      if name in request.bundle)
        for node_id, res in _available_per_node().items()
    )
    return LaunchConfigError(
        f"the Ray cluster could not place {request.describe()} within {waited_s:g} s: other work holds the "
        f"resources ({free or 'nothing free'}). Wait for it, or ask for less."
    )


def release(ray: Any, agents: list[Any], group: Any) -> None:
    """Kill the agents (their ranks die with them) and remove the placement group; returns once
    Ray has them dead, so nothing of the launch is listed afterwards. Whatever happens while
    the agents go (a second interrupt), the group is removed: it would hold the nodes."""
    from ray.util.placement_group import remove_placement_group

    try:
        for agent in agents:
            try:
                ray.kill(agent, no_restart=True)
            except Exception:
                pass  # already gone
        # A call on a killed actor fails once it is dead: waiting for those calls waits for the deaths.
        ray.wait([agent.where.remote() for agent in agents], num_returns=len(agents), timeout=10.0)
    finally:
        if group is not None:
            remove_placement_group(group)  # synchronous: the GCS has removed it when this returns


def is_placed(ray: Any, group: Any) -> bool:
    return ray.util.placement_group_table(group).get("state") == "CREATED"


def _available_per_node() -> dict[str, dict[str, float]]:
    try:
        from ray._private.state import available_resources_per_node
    except ImportError:
        return {}
    try:
        return available_resources_per_node()
    except Exception:
        return {}
