"""Where a launch's ranks live: the one seam between a :class:`~nblaunch.launch.handle.Launch`
and the processes it runs.

A *home* starts every rank of one attempt and hands back what watches them (a
:class:`RankWatcher`). The launch itself (its display, logs, restarts, timeout budget, the
``block=False`` handle) is the same wherever the ranks run. Two homes exist:

- :class:`LocalHome`: processes of this machine, watched by the :class:`Supervisor`.
- ``nblaunch.cluster.ray_home.RayHome``: one agent per Ray node, each running a launch of its
  own node's ranks with a :class:`LocalHome`; the agents' event streams are merged here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, ContextManager, Iterator, Protocol

from nblaunch import proctree
from nblaunch.events import Event
from nblaunch.launch import registry
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.starting.base import Starter, kill_and_reap
from nblaunch.launch.starting.fork import ForkStarter
from nblaunch.launch.starting.payload import Payload, package
from nblaunch.launch.starting.processes import WorkerProcess
from nblaunch.launch.starting.spawn import SpawnStarter
from nblaunch.launch.supervising.supervisor import Supervisor



def starter_for(start_method: str) -> Starter:
    """The :class:`Starter` a plan's ``start_method`` names."""
    if start_method == "xla":
        # Deferred: TPU hosts only; it loads the XLA host's worker code, which no other launch needs.
        from nblaunch.launch.starting.xla_host import XlaHostStarter

        return XlaHostStarter()
    return SpawnStarter() if start_method == "spawn" else ForkStarter()


class RankWatcher(Protocol):
    """Watches one attempt's ranks to the end. ``cancel``, ``request_stacks`` and
    ``send_to_ranks`` are safe from any thread."""

    def run(self) -> list[Any]: ...

    def cancel(self, raising: BaseException | None = None) -> None: ...

    def request_stacks(self) -> None: ...

    def send_to_ranks(self, kind: bytes, body: bytes = b"", shared: Payload | None = None) -> None: ...


class RanksHome(Protocol):
    """Where the ranks of a launch run."""

    def prepare(self, plan: LaunchPlan, launch_id: str) -> None:
        """Called by each new launch on the caller's thread, before anything is shown."""

    def package(self, value: Any) -> Payload:
        """``value`` (a warm call) pickled for ranks that do not share this process's memory."""

    def rank_count(self, plan: LaunchPlan) -> int:
        """How many ranks this launch shows (its display and logs have one pane/file each)."""

    def describe(self, plan: LaunchPlan) -> dict[str, Any]:
        """``LaunchStarted`` fields that differ from the plan's own (start method, rendezvous...)."""

    def attempt(self, plan: LaunchPlan, function: Callable, args: tuple, emit: Callable[[Event], None],
                timeout: float | None, log_dir: str) -> ContextManager[RankWatcher]:
        """Start every rank of ``plan``; on leaving, nothing of the attempt is left running."""


class LocalHome:
    """Ranks as processes of this machine (fork, spawn, or the XLA host)."""

    def __init__(self) -> None:
        self._launch_id = ""
        self._inherited: dict[str, str] = {}
        self._starter: Starter = ForkStarter()

    def prepare(self, plan: LaunchPlan, launch_id: str) -> None:
        # On the caller's thread: the imports for the ranks touch os.environ, which a launch
        # thread must never do, and may fail before anything is open or shown. Every process
        # of the launch inherits the tag, whatever session it makes for itself.
        self._launch_id = launch_id
        self._starter = starter_for(plan.start_method)
        self._inherited = dict(self._starter.environ_for_ranks(plan), **{proctree.LAUNCH_ID_VARIABLE: launch_id})
        for message in registry.stop_stale_ranks():
            print(f"nblaunch: {message}", file=sys.stderr)

    def package(self, value: Any) -> Payload:
        return package(value)  # big tensors and arrays in memfds the ranks map

    def rank_count(self, plan: LaunchPlan) -> int:
        return plan.num_processes

    def describe(self, plan: LaunchPlan) -> dict[str, Any]:
        return {}

    @contextlib.contextmanager
    def attempt(self, plan: LaunchPlan, function: Callable, args: tuple, emit: Callable[[Event], None],
                timeout: float | None, log_dir: str) -> Iterator[Supervisor]:
        record = None
        workers: list[WorkerProcess] = []
        supervisor: Supervisor | None = None
        try:
            workers = self._starter.start(plan, function, args, self._inherited)
            record = registry.LaunchRecord(
                launch_id=self._launch_id, launcher_pid=os.getpid(), port=plan.master_port,
                ranks=[(w.pid, proctree.start_ticks(w.pid)) for w in workers], log_dir=log_dir,
                pipes=[end for w in workers for end in w.rank_pipe_ends()],
            )
            record.save()
            supervisor = Supervisor(workers, emit, timeout)
            yield supervisor
        except BaseException:
            kill_and_reap(workers)  # normally done by the supervisor; not if starting failed midway
            raise
        finally:
            self._starter.release()
            if workers and not (supervisor is not None and supervisor.ended_cleanly):
                # A rank that was killed could not stop what it had started: find it by its marks.
                if record is not None:
                    record.kill_marked()
                else:  # interrupted before its record was made: the environment mark alone
                    proctree.kill_marked(self._launch_id, set(), None)
            if record is not None:
                record.remove()
