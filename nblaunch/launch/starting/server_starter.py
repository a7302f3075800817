"""Ranks forked by the launch server: the start of a launch that cannot fork from this process
(CUDA already initialised here, or ``start_method="spawn"``), without a fresh interpreter each
time, and warm (``launch/ahead``).

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
    starter.after(plan)                      # the server warms up for the next launch
"""

from __future__ import annotations

import os

from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes import fdtable
from nblaunch.launch.starting.base import Starter, rank_settings, start_each_rank
from nblaunch.launch.processes.packing import Payload, package
from nblaunch.launch.processes.processes import Pipes, WorkerProcess, handle_for, kill_and_reap
from nblaunch.launch.starting.spawn import send_payload
from nblaunch.launch.ahead.launch_server import LaunchServer, launch_server
from nblaunch.launch.ahead.ledger import ledger
from nblaunch.launch.ahead.server_link import ServerLink
from nblaunch.launch.ahead.standby import ServerChild, Shape
from nblaunch.launch.ahead.stepping_aside import launches
from nblaunch.worker.bootstrap import WorkerSettings


class ServerStarter(Starter):
    """One process per rank, forked by this process's launch server."""

    def __init__(self) -> None:
        self._payload: Payload | None = None
        self._shape: Shape | None = None
        self._alone: bool | None = None  # this attempt runs, and whether alone (ahead/stepping_aside)
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
        try:
            try:
                workers = self._fork_every_rank(plan, environ, waiting, here, cwd)
            except RuntimeError:
                # A process of the server that died since the last launch (killed, out of memory;
                # or dying now, and its generations with it) can be chosen before its reader has
                # heard. Ask again, once, where the server is now (a new one if the base died): no
                # rank had its function yet.
                self._server = launch_server()
                workers = self._fork_every_rank(plan, environ, {}, here, cwd)
        finally:
            kill_and_reap(list(waiting.values()))  # claimed, but never handed a launch
        for worker, settings in zip(workers, rank_settings(plan, environ)):
            send_payload(worker.ranks[0], settings, payload, memfds_on_the_socket=True)
        return workers

    def _fork_every_rank(self, plan: LaunchPlan, environ: dict[str, str], waiting: dict[int, WorkerProcess],
                         here: dict[str, str], cwd: str) -> list[WorkerProcess]:
        """A process for each rank, waiting for its function: a claimed one, or one forked by
        the server's best process; none is left if one fails."""
        source: list[ServerLink] = []

        def start_one(settings: WorkerSettings) -> WorkerProcess:
            worker = waiting.pop(settings.rank, None)
            if worker is None:
                source[:] = source or [self._server.source_for(here)]
                worker = _fork_there(source[0], settings, here, cwd)
            return worker

        workers = start_each_rank(plan, environ, start_one)
        if source and not self._server.runs(source[0]):  # its ranks die with it
            kill_and_reap(workers)
            raise RuntimeError(f"nblaunch's launch server ({source[0].name}) died as the ranks were forked")
        return workers

    def release(self) -> None:
        if self._payload is not None:
            fdtable.close(self._payload.fds)  # ranks that mapped the memory keep it
            self._payload = None

    def after(self, plan: LaunchPlan) -> None:
        if self._alone is not None:
            launches().ended(self._alone)
            self._alone = None
        if self._shape is not None and self._server is not None and self._server.alive:
            self._server.after_launch(self._shape)

    def learned(self, imported: list[str]) -> None:
        super().learned(imported)
        if self._server is not None and self._server.alive:
            self._server.warm_up_soon()  # a generation with it, on spare cores, while the ranks run

    def ready_next(self) -> None:
        server = self._server
        if server is not None and server.alive and server.lacks(ledger().for_server()):
            server.wait_warm()


def _fork_there(source: ServerLink, settings: WorkerSettings, here: dict[str, str], cwd: str) -> WorkerProcess:
    pipes = Pipes.open()
    try:
        pid = source.start_rank(pipes, dict(here, **settings.environ), cwd)
    except BaseException:
        fdtable.close(pipes.launcher_ends + pipes.worker_ends)
        raise
    return handle_for(pid, {settings.rank: pipes}, reaper=ServerChild(source, pid))
