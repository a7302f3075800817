"""The agent on one Ray node: an ordinary nblaunch launch of that node's ranks.

Ray starts one :class:`NodeAgent` actor per node (in the launch's placement group); the agent
runs :class:`~nblaunch.launch.handle.Launch` there with ``LocalCluster``, so forking, lifelines,
stacks, teardown and logs are exactly those of a launch on one machine. Its display is a queue:
the driver long-polls ``next_events`` and merges every node's stream into the cell.

The agent's ranks die with it: they are forked from its forking thread (PR_SET_PDEATHSIG), and
Ray kills a job's actors when the driver (the notebook's kernel) goes away. An agent serves one
launch after another (``ray_nodes`` keeps it between them), each with a queue of its own.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

import cloudpickle

from nblaunch.contract.version import __version__
from nblaunch.events import Event, LaunchFinished, LaunchStarted
from nblaunch.launch.errors import LaunchConfigError, LaunchTimeoutError, RankFailedError
from nblaunch.launch.handle import Launch
from nblaunch.launch.local_cluster import LocalCluster
from nblaunch.launch.planning import ports
from nblaunch.launch.planning.request import DEFAULT_MASTER_ADDR, LaunchRequest

_MAX_BATCH = 2000  # events per answer: a chatty node's backlog goes in several round trips


class _EventQueue:
    """The agent's display: events kept until the driver takes them."""

    def __init__(self) -> None:
        self.ready = threading.Condition()
        self.events: list[Event] = []
        self.outcome: tuple | None = None

    def on_event(self, event: Event) -> None:
        if isinstance(event, (LaunchStarted, LaunchFinished)):
            return  # the driver's launch says these, for every node at once
        with self.ready:
            self.events.append(event)
            self.ready.notify_all()

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class NodePlace:
    """A node's part of a Ray launch: its number, and where the ranks of every node meet."""

    node_rank: int
    master_addr: str
    master_port: int


def check_cluster_request(request: LaunchRequest, cluster: str, who_starts: str, hint: str = "") -> None:
    """What every cluster refuses alike: a node number or meeting point of the user's own
    (the cluster places every node; node 0 hosts the rendezvous), a start method other than fork or
    spawn, restarts. ``who_starts`` says who places the nodes ("Ray places"); ``hint`` ends the
    first message."""
    if request.node_rank != 0 or request.master_addr != DEFAULT_MASTER_ADDR:
        raise LaunchConfigError(
            f"with cluster='{cluster}', {who_starts} every node and node 0 hosts the rendezvous: leave node_rank, "
            f"master_addr and rdzv_endpoint out{hint}")
    if request.start_method not in (None, "fork", "spawn"):
        raise LaunchConfigError(f"with cluster='{cluster}', start_method must be None, 'fork' or 'spawn'; got "
                                f"{request.start_method!r}")
    if request.max_restarts != 0:
        raise LaunchConfigError(f"max_restarts is not supported with cluster='{cluster}' yet: pass max_restarts=0, or "
                                "resume from a checkpoint with a new launch")


class NodeAgent:
    """Runs one node's ranks for the driver. Used as a Ray actor (see ``ray_cluster``).

    Example (what the driver does)::

        agent = ray.remote(NodeAgent).options(...).remote()
        address, port, version = ray.get(agent.where.remote())
        ray.get(agent.start.remote(packed_request, NodePlace(0, address, port), driver_path))
        events, outcome = ray.get(agent.next_events.remote(0.2))
    """

    def __init__(self) -> None:
        # Forked ranks inherit what the agent imported: torch once here, not once per rank;
        # in the background, so that placing the other nodes and naming the rendezvous go on.
        self._imported = threading.Thread(target=_import_torch, name="nblaunch-agent-imports", daemon=True)
        self._imported.start()
        self._queue = _EventQueue()
        self._launch: Launch | None = None

    def where(self) -> tuple[str, int, str]:
        """This node's address, a port free on it now (used when it is node 0), nblaunch's version."""
        import ray

        address = ray.util.get_node_ip_address()
        return address, ports.choose_port(address, None, hosted_here=True), __version__

    def start(self, packed_request: bytes, place: NodePlace, driver_path: list[str]) -> None:
        """Start this node's launch: ``packed_request`` is the cloudpickled request every node
        shares (the function and its arguments with it), ``place`` this node's part. Returns once
        the ranks are starting."""
        # Functions from the notebook's own modules travel by reference: where the driver's
        # folders exist here too (one machine, a shared file system), they import as there.
        sys.path.extend(p for p in driver_path if p not in sys.path and os.path.isdir(p))
        self._imported.join()
        self._queue = _EventQueue()  # a kept agent's earlier launch left its own
        request = dataclasses.replace(cloudpickle.loads(packed_request), node_rank=place.node_rank,
                                      master_addr=place.master_addr, use_port=place.master_port, display=self._queue)
        self._launch = Launch(LocalCluster(request))
        self._launch.start()
        threading.Thread(target=self._wait_for_end, name="nblaunch-agent-outcome", daemon=True).start()

    def next_events(self, wait_s: float) -> tuple[list[Event], tuple | None]:
        """The events since the last answer, waiting up to ``wait_s`` for one; and, once the
        node's launch is over, its outcome (see ``_outcome``)."""
        queue = self._queue
        with queue.ready:
            queue.ready.wait_for(lambda: queue.events or queue.outcome is not None, wait_s)
            events, queue.events = queue.events[:_MAX_BATCH], queue.events[_MAX_BATCH:]
            return events, (queue.outcome if not queue.events else None)

    def cancel(self, why: str) -> None:
        """Stop this node's ranks as an interrupt would (stacks first); ``why`` becomes the error."""
        if self._launch is not None:
            self._launch.cancel(LaunchTimeoutError(0, {}) if why == "timeout" else None)

    def request_stacks(self) -> None:
        if self._launch is not None:
            self._launch.request_stacks()

    def send(self, kind: bytes, body: bytes) -> bool:
        """One frame to every rank of this node (a warm pool's call)."""
        return self._launch is not None and self._launch.send(kind, body)

    def _wait_for_end(self) -> None:
        assert self._launch is not None
        try:
            outcome = ("done", cloudpickle.dumps(self._launch.result()))
        except RankFailedError as error:
            # Each record carries its exception as bytes of its own (contract.failure): one the
            # driver cannot load arrives as a stand-in, the rest of the record whole.
            outcome = ("failed", error.failures)
        except LaunchTimeoutError:
            outcome = ("timed out", None)
        except BaseException as error:  # cancelled, interrupted, or the launch itself broke
            outcome = ("stopped", f"{type(error).__name__}: {error}")
        with self._queue.ready:
            self._queue.outcome = outcome
            self._queue.ready.notify_all()


def _import_torch() -> None:
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        pass  # the function may not need it; if it does, its rank says so
