"""Spawn: every rank is a fresh interpreter (``python -m nblaunch.worker``) that receives the
function and its arguments, cloudpickled, on its control socket. Used where fork is not safe at
all (not Linux); on Linux a launch that cannot fork from here has its ranks forked by the launch
server instead (``server_starter``), which receives them the same way (:func:`send_payload`)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading

from nblaunch import wire
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes import fdtable
from nblaunch.launch.starting.base import Starter, start_each_rank
from nblaunch.launch.processes.packing import Payload, package
from nblaunch.launch.processes.processes import PACKAGE_ROOT, Pipes, RankPipes, WorkerProcess, handle_for
from nblaunch.worker.bootstrap import WorkerSettings


# The folder that holds the nblaunch package (three levels above this file): a spawned rank
# imports this nblaunch, also where it is not installed (a clone on sys.path).


class SpawnStarter(Starter):
    """One fresh interpreter per rank; big tensors and arrays reach them through memfds."""

    def __init__(self) -> None:
        self._payload: Payload | None = None

    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        payload = self._payload = package((plan.request.function, plan.request.args))
        return start_each_rank(plan, environ,
                               lambda settings: spawn_rank(settings, payload, dict(os.environ, **settings.environ)))

    def release(self) -> None:
        if self._payload is not None:
            fdtable.close(self._payload.fds)  # ranks that mapped the memory keep it
            self._payload = None


def spawn_rank(settings: WorkerSettings, payload: Payload, environ: dict[str, str]) -> WorkerProcess:
    """Start one rank as a fresh interpreter that receives the function on its control socket."""
    pipes = Pipes.open()
    env = dict(environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    popen = subprocess.Popen(
        [sys.executable, "-m", "nblaunch.worker", str(pipes.control[0]), str(pipes.events[1]), str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=pipes.stdout[1],
        stderr=pipes.stderr[1],
        pass_fds=(pipes.control[0], pipes.events[1], *payload.fds),  # memfds: mapped by their numbers
        env=env,
        start_new_session=True,  # a process group of its own, like a forked rank
    )
    worker = handle_for(popen.pid, {settings.rank: pipes}, reaper=popen)
    send_payload(worker.ranks[0], settings, payload, memfds_on_the_socket=False)
    return worker


def send_payload(rank: RankPipes, settings: WorkerSettings, payload: Payload, *, memfds_on_the_socket: bool) -> None:
    """Send a starting rank its settings, then the function and its arguments, on its control
    socket, in a thread of their own (a large payload fills the socket before the rank reads it).
    The payload's memfds are inherited by a spawned rank (the same numbers); for a rank the launch
    server forked they ride on a SHARED frame first (``memfds_on_the_socket``)."""
    head = wire.encode(wire.SPAWN_SETTINGS, pickle.dumps((settings, payload.buffers), protocol=pickle.HIGHEST_PROTOCOL))
    # The pickle is written as it is, never joined to a header: no copy of it per rank.
    pieces = [head, wire.HEADER.pack(wire.PAYLOAD, len(payload.data)), payload.data]
    shared = payload if memfds_on_the_socket and payload.fds else None
    rank.payload_sender = threading.Thread(target=_send, args=(rank.control_fd, pieces, shared), daemon=True)
    rank.payload_sender.start()


def _send(fd: int, pieces: list[bytes], shared: Payload | None) -> None:
    try:
        if shared is not None:
            note = pickle.dumps((shared.fds, []), protocol=pickle.HIGHEST_PROTOCOL)
            wire.write_frame_with_fds(fd, wire.SHARED, note, shared.fds)
        for piece in pieces:
            wire.write_all(fd, piece)
    except OSError:
        pass  # the rank died before reading it; the supervisor reports that
