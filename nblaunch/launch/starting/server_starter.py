"""Ranks forked by the launch server: the start of a launch that cannot fork from this process
(CUDA already initialised here, or ``start_method="spawn"``), without a fresh interpreter each
time.

:class:`ServerStarter` takes this process's server (``server.fitting_server``: replaced whole
when it no longer fits), has it import what the ranks will import (``rank_imports``; a package
that raises there is left to the ranks, one that would leave the server unfit to fork them (it
starts CUDA or a thread, reads a rank's variables, hangs) is refused and the server replaced
without it), asks it for one process per rank, handing over each rank's pipe ends, then sends
each rank its function and arguments on its control socket as a spawned rank gets them (big
tensors as memfds, which ride on a SHARED frame here). A rank's exit code comes from the server,
which reaps it; the launcher still sees its exit through a pidfd and kills it, its group and its
tree by pid, as any rank.

Example::

    starter = ServerStarter()
    starter.prepare(plan)                    # "imported sklearn, torch._dynamo there first (3.1 s)"
    workers = starter.start(plan, environ)   # one WorkerProcess per rank
"""

from __future__ import annotations

import os
import sys
import threading
import time

from nblaunch.machine.cuda import cuda_initialized
from nblaunch.machine.installed import top_level
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes import fdtable
from nblaunch.launch.processes.packing import Payload, package
from nblaunch.launch.processes.processes import Pipes, WorkerProcess, handle_for, kill_and_reap
from nblaunch.launch.starting import rank_imports
from nblaunch.launch.starting.base import Starter, rank_settings, start_each_rank
from nblaunch.launch.starting.preload import OK, SAID_FROM_S, preloading
from nblaunch.launch.starting.server import PACKAGE_HANGS_S, LaunchServer, ServerChild, ServerLost, fitting_server
from nblaunch.launch.starting.spawn import send_payload
from nblaunch.per_process import per_process
from nblaunch.worker.bootstrap import WorkerSettings

_TRIES = 3  # servers tried for one launch, each without what made the one before unfit
# What a first training step imports: a server started early imports it before any launch asks.
FIRST_TRAINING_STEP = [(rank_imports.TRAINS, ()), ("nblaunch.training", ())]


class ServerStarter(Starter):
    """One process per rank, forked by this process's launch server."""

    def __init__(self) -> None:
        self._payload: Payload | None = None
        self._server: LaunchServer | None = None  # the one this launch's ranks come from
        self._wanted: list[rank_imports.Wanted] = []

    def prepare(self, plan: LaunchPlan) -> str:
        request = plan.request
        self._wanted = rank_imports.wanted(request.function, request.args) if preloading() else []
        began = time.monotonic()
        self._server, imported = ready_server(self._wanted)
        took = time.monotonic() - began
        return f"{', '.join(imported)} imported there first ({took:.1f} s)" if imported and took >= SAID_FROM_S else ""

    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        payload = self._payload = package((plan.request.function, plan.request.args))
        here, cwd = dict(os.environ), os.getcwd()  # the ranks' environment is this process's now
        try:
            workers = self._fork_every_rank(plan, environ, here, cwd)
        except ServerLost:
            # A server that died since the last launch (killed, out of memory) can be chosen
            # before its reader has heard. Ask again, once, a server that runs: no rank had its
            # function yet.
            self._server, _ = ready_server(self._wanted)
            workers = self._fork_every_rank(plan, environ, here, cwd)
        for worker, settings in zip(workers, rank_settings(plan, environ)):
            send_payload(worker.ranks[0], settings, payload, memfds_on_the_socket=True)
        return workers

    def _fork_every_rank(self, plan: LaunchPlan, environ: dict[str, str], here: dict[str, str],
                         cwd: str) -> list[WorkerProcess]:
        server = self._server
        if server is None or not server.alive:
            server = self._server = ready_server(self._wanted)[0]
        workers = start_each_rank(plan, environ, lambda settings: _fork_there(server, settings, here, cwd))
        if not server.alive:  # its ranks die with it
            kill_and_reap(workers)
            raise ServerLost(server.why_dead())
        return workers

    def release(self) -> None:
        if self._payload is not None:
            fdtable.close(self._payload.fds)  # ranks that mapped the memory keep it
            self._payload = None


def ready_server(wanted: list[rank_imports.Wanted]) -> tuple[LaunchServer, list[str]]:
    """A server that fits this process's environment now, with ``wanted`` imported there (see the
    module); and what it imported now. Raises ServerLost after ``_TRIES`` servers."""
    refused = server_refusals()
    lost: ServerLost | None = None
    for _ in range(_TRIES):
        environ = dict(os.environ)
        server = fitting_server(environ)
        try:
            verdicts = server.preload([w for w in wanted if w[0] not in refused.why and top_level(w[0]) not in refused.why],
                                      environ)
        except ServerLost as error:
            lost = error
            if error.hung is not None:
                refused.refuse(error.hung, f"its import did not finish within {PACKAGE_HANGS_S:g} s")
            elif server.loading is not None:  # it died importing it (a crash in a library's C code)
                refused.refuse(server.loading[0], f"its import ended the launch server ({server.why_dead()})")
            continue
        for name, verdict in verdicts.items():
            if verdict != OK:
                refused.refuse(name, verdict)
        if all(v == OK or v.startswith("raised") for v in verdicts.values()):
            return server, [name for name, verdict in verdicts.items() if verdict == OK]
        server.wait_gone()  # it exits after a verdict that leaves it unfit: the next try starts another
    raise lost or ServerLost("nblaunch's launch server could not be started")


def _fork_there(server: LaunchServer, settings: WorkerSettings, here: dict[str, str], cwd: str) -> WorkerProcess:
    pipes = Pipes.open()
    try:
        pid = server.start_rank(pipes, dict(here, **settings.environ), cwd)
    except BaseException:
        fdtable.close(pipes.launcher_ends + pipes.worker_ends)
        raise
    return handle_for(pid, {settings.rank: pipes}, reaper=ServerChild(server, pid))


class ServerRefusals:
    """Packages never imported in this process's launch servers again, and why; each said once."""

    def __init__(self) -> None:
        self.why: dict[str, str] = {}
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def refuse(self, package: str, why: str) -> None:
        with self._lock:
            self.why.setdefault(package, why)

    def notices(self) -> list[str]:
        with self._lock:
            new = [p for p in self.why if p not in self._said]
            self._said.update(new)
            return [f"could not import {p} in the launch server for the ranks: {self.why[p]}. Each launch's ranks "
                    "import it themselves." for p in new]


server_refusals = per_process(ServerRefusals)


def start_early() -> None:
    """At ``import nblaunch`` in a notebook on Linux: where CUDA is started here already, every
    launch's ranks come from the launch server, so it starts now and imports what a first training
    step needs while the user writes the next cell; where torch starts CUDA later, then. Cheap:
    a starting server costs this process a ``Popen``."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is None or not sys.platform.startswith("linux") or not preloading():
        return
    if cuda_initialized():
        _start_now()
        return
    from nblaunch.after_import import when_imported  # deferred: only notebooks ask

    def when_torch_starts_cuda(torch_cuda: object) -> None:
        try:
            torch_cuda._lazy_call(_start_now)  # run by torch as it starts CUDA, on the user's thread
        except Exception:  # noqa: BLE001  a torch without the hook: the first launch starts it
            pass

    when_imported("torch.cuda", when_torch_starts_cuda)


def _start_now() -> None:
    try:
        fitting_server(dict(os.environ)).preload_soon(FIRST_TRAINING_STEP, dict(os.environ))
    except Exception:  # noqa: BLE001  an early start only: the first launch starts it otherwise
        pass
