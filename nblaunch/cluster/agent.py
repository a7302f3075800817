"""The agent on one Ray node: an ordinary nblaunch launch of that node's ranks.

Ray starts one :class:`NodeAgent` actor per node (in the launch's placement group); the agent
runs :class:`~nblaunch.launch.handle.Launch` there with the local home, so forking, lifelines,
stacks, teardown and logs are exactly those of a launch on one machine. Its display is a queue:
the driver long-polls ``next_events`` and merges every node's stream into the cell.

The agent's ranks die with it: they are forked from its forking thread (PR_SET_PDEATHSIG), and
Ray kills a job's actors when the driver (the notebook's kernel) goes away.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from typing import Any

import cloudpickle

import nblaunch
from nblaunch.events import Event, LaunchFinished, LaunchStarted
from nblaunch.launch.errors import LaunchTimeoutError, RankFailedError, RankFailure
from nblaunch.launch.handle import Launch
from nblaunch.launch.planning import ports
from nblaunch.launch.planning.plan import LaunchRequest, make_plan

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


class NodeAgent:
    """Runs one node's ranks for the driver. Used as a Ray actor (see ``ray_home``).

    Example (what the driver does)::

        agent = ray.remote(NodeAgent).options(...).remote()
        address, port, version = ray.get(agent.where.remote())
        ray.get(agent.start.remote(packed_call, options, driver_path))
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
        return address, ports.choose_port(address, None, hosted_here=True), nblaunch.__version__

    def start(self, packed_call: bytes, options: dict[str, Any], driver_path: list[str]) -> None:
        """Start this node's launch: ``packed_call`` is the cloudpickled ``(function, args)``;
        ``options`` the node's ``LaunchRequest`` fields. Returns once the ranks are starting."""
        # Functions from the notebook's own modules travel by reference: where the driver's
        # folders exist here too (one machine, a shared file system), they import as there.
        sys.path.extend(p for p in driver_path if p not in sys.path and os.path.isdir(p))
        self._imported.join()
        function, args = cloudpickle.loads(packed_call)
        plan = make_plan(LaunchRequest(function, args, display=self._queue, **options))
        self._launch = Launch(plan, function, args, None, self._queue)
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
            outcome = ("failed", [_portable(f) for f in error.failures])
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


def _portable(failure: RankFailure) -> tuple[RankFailure, bytes | None]:
    """A failure the driver can unpickle: its exception travels as bytes of its own (the
    driver rebuilds a stand-in if they do not load there)."""
    try:
        exception = cloudpickle.dumps(failure.exception)
    except Exception:
        exception = None
    plain = RankFailure(**{**failure.__dict__, "exception": None})
    pickle.dumps(plain)  # everything else is text and numbers
    return plain, exception
