"""Ranks forked by the launch server: the start of a launch that cannot fork from this process
(CUDA already initialised here, or ``start_method="spawn"``), without a fresh interpreter each
time, and warm (``launch/warm_start``).

:class:`ServerStarter` claims the ranks waiting on standby for this launch's shape, asks the
server's best process for the others (``LaunchServer.source_for``), handing over each rank's pipe
ends, then sends each rank its function and arguments on its control socket as a spawned rank
gets them (big tensors as memfds, which ride on a SHARED frame here). A rank's exit code comes
from the server, which reaps it; the launcher still sees its exit through a pidfd and kills it,
its group and its tree by pid, as any rank. After the launch the server warms up for the next.

Example::

    starter = ServerStarter()
    starter.environ_for_ranks(plan)          # starts the server if none runs (returns at once)
    workers = starter.start(plan, environ)   # one WorkerProcess per rank
    starter.after(plan, imported)            # what the ranks imported: loaded for the next launch
"""

from __future__ import annotations

import os

from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.starting import fdtable
from nblaunch.launch.starting.base import Starter, start_each_rank
from nblaunch.launch.starting.packing import Payload, package
from nblaunch.launch.starting.processes import Pipes, WorkerProcess, handle_for, kill_and_reap
from nblaunch.launch.starting.spawn import send_payload
from nblaunch.launch.warm_start.cells import cells
from nblaunch.launch.warm_start.launch_server import LaunchServer, launch_server
from nblaunch.launch.warm_start.ledger import ledger
from nblaunch.launch.warm_start.server_link import ServerLink
from nblaunch.launch.warm_start.standby import ServerChild, Shape
from nblaunch.launch.warm_start.stepping_aside import launches
from nblaunch.worker.bootstrap import WorkerSettings


class ServerStarter(Starter):
    """One process per rank, forked by this process's launch server."""

    def __init__(self) -> None:
        self._payload: Payload | None = None
        self._shape: Shape | None = None
        self._alone: bool | None = None  # this attempt runs, and whether alone (warm_start/stepping_aside)
        self._server: LaunchServer | None = None  # the one this attempt's ranks came from

    def environ_for_ranks(self, plan: LaunchPlan) -> dict[str, str]:
        launch_server()  # started now, on the caller's thread: torch imports there meanwhile
        return {}

    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        payload = self._payload = package((plan.request.function, plan.request.args))
        server = self._server = launch_server()
        here, cwd = dict(os.environ), os.getcwd()  # the ranks' environment is this process's now
        self._shape = Shape.of(plan, here, cwd)
        if self._alone is None:
            self._alone = launches().began(plan)
        waiting = server.claim_standby(self._shape)
        sources: list[ServerLink] = []  # where this attempt's ranks are forked: one, or a second if the first was dead
        forked_from_it: list[int] = []  # the ranks forked from sources[-1]

        def start_one(settings: WorkerSettings) -> WorkerProcess:
            worker = waiting.pop(settings.rank, None)
            if worker is None:
                if not sources:
                    sources.append(self._server.source_for(here))
                try:
                    worker = _fork_there(sources[-1], settings, here, cwd)
                except RuntimeError:
                    # A process of the server that died since the last launch (killed, out of
                    # memory) can be chosen before its reader has heard: ask again, once, while
                    # no rank of this attempt came from it. Ranks that did died with it.
                    if sources[-1].alive or len(sources) > 1 or forked_from_it:
                        raise
                    self._server = launch_server()  # a new one if the base was what died
                    sources.append(self._server.source_for(here))
                    worker = _fork_there(sources[-1], settings, here, cwd)
                forked_from_it.append(settings.rank)
            send_payload(worker.ranks[0], settings, payload, memfds_on_the_socket=True)
            return worker

        try:
            return start_each_rank(plan, environ, start_one)
        finally:
            kill_and_reap(list(waiting.values()))  # claimed, but never handed a launch

    def release(self) -> None:
        if self._payload is not None:
            fdtable.close(self._payload.fds)  # ranks that mapped the memory keep it
            self._payload = None

    def after(self, plan: LaunchPlan, imported: list[str]) -> None:
        ledger().learn(imported)
        if self._alone is not None:
            launches().ended(self._alone)
            self._alone = None
        if self._shape is not None and self._server is not None and self._server.alive:
            self._server.after_launch(self._shape)

    def ready_next(self) -> None:
        server = self._server
        if server is not None and server.alive and server.lacks(ledger().for_server()):
            with cells().parked():  # counts as idle for this process's own imports too
                server.wait_warm()


def _fork_there(source: ServerLink, settings: WorkerSettings, here: dict[str, str], cwd: str) -> WorkerProcess:
    pipes = Pipes.open()
    try:
        pid = source.start_rank(pipes, dict(here, **settings.environ), cwd)
    except BaseException:
        fdtable.close(pipes.launcher_ends + pipes.worker_ends)
        raise
    return handle_for(pid, {settings.rank: pipes}, reaper=ServerChild(source, pid))
