"""Ranks forked by the launch server: the start of a launch that cannot fork from this process
(CUDA already initialised here, or ``start_method="spawn"``), without a fresh interpreter each time.

:class:`LaunchServer` is this process's handle on its server (``nblaunch.worker.fork_server``):
started on first need, in the background (torch imports there while the launch shows itself),
reused by every later launch, started again if it died. :class:`ServerStarter` asks it for one
process per rank, handing over the rank's pipe ends, then sends each rank its function and
arguments on its control socket as a spawned rank gets them (big tensors as memfds, which ride
on a SHARED frame here). A rank's exit code comes from the server, which reaps it; the launcher
still sees its exit through a pidfd and kills it, its group and its tree by pid, as any rank.

Example::

    starter = ServerStarter()
    starter.environ_for_ranks(plan)          # starts the server if none runs (returns at once)
    workers = starter.start(plan, environ)   # one WorkerProcess per rank, forked by the server
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import pickle
import subprocess
import sys
import threading

from nblaunch import wire
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.starting import fdtable
from nblaunch.launch.starting.base import Starter, start_each_rank
from nblaunch.launch.starting.forking_thread import run_on_forking_thread
from nblaunch.launch.starting.packing import Payload, package
from nblaunch.launch.starting.processes import Pipes, WorkerProcess, handle_for
from nblaunch.launch.starting.spawn import PACKAGE_ROOT, send_payload
from nblaunch.worker.bootstrap import WorkerSettings

_READY_BACKSTOP_S = 300.0  # importing torch takes seconds; a server that never gets there is broken
_KILLED = -9  # the exit code of a rank whose server died before reporting it: it died with it


class LaunchServer:
    """This process's launch server. Thread-safe: launches on several threads share it."""

    def __init__(self) -> None:
        # Registered before anything can fork (a launch on another thread, a DataLoader): a copy
        # of the server's end in any child would hide the server's death from the reader for good.
        self._fd, theirs = fdtable.new_socketpair()
        environ = dict(os.environ)
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, environ.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "nblaunch.worker.fork_server", str(theirs), str(os.getpid())]

        def start() -> subprocess.Popen:  # on the forking thread: the server's death signal is tied to it
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=(theirs,), env=environ,
                                    start_new_session=True)  # not in the kernel's group: interrupts are the kernel's

        try:
            self._process = run_on_forking_thread(start, undo=_stop)
        except BaseException:
            fdtable.close([self._fd])
            raise
        finally:
            fdtable.close([theirs])
        self._ready = threading.Event()
        self._changed = threading.Condition()
        self._started: dict[int, concurrent.futures.Future] = {}
        self._exit_codes: dict[int, int] = {}
        self._dead = False
        self._send_lock = threading.Lock()  # also keeps the socket open while a frame is written
        self._ids = itertools.count()
        threading.Thread(target=self._read, name="nblaunch-launch-server", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._dead

    def start_rank(self, pipes: Pipes, environ: dict[str, str]) -> int:
        """A process forked by the server on the rank ends of ``pipes``, in ``environ`` and this
        process's folder; its pid. Raises RuntimeError if the server cannot (it died, or failed)."""
        if not self._ready.wait(_READY_BACKSTOP_S):
            self._give_up(f"it was not ready within {_READY_BACKSTOP_S:g} s")
        done: concurrent.futures.Future = concurrent.futures.Future()
        request_id = next(self._ids)
        with self._changed:
            self._started[request_id] = done
        body = pickle.dumps((request_id, environ, os.getcwd()), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self._dead:
                raise RuntimeError(self._why_dead())
            try:
                wire.write_frame_with_fds(self._fd, wire.SERVER_START, body, pipes.worker_ends)
            except OSError:
                pass  # it died: the reader finds out, and answers the request
        return done.result()

    def exit_code(self, pid: int, wait: bool) -> int | None:
        """The exit code of rank ``pid`` (-signal if killed), once the server has reaped it;
        None if it runs and ``wait`` is False."""
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: pid in self._exit_codes or self._dead)
            if pid in self._exit_codes:
                return self._exit_codes.pop(pid)
            return _KILLED if self._dead else None

    def _read(self) -> None:
        reader = wire.FrameReader()
        try:
            while chunk := os.read(self._fd, 1 << 16):
                for kind, body in reader.feed(chunk):
                    self._on_frame(kind, body)
        except Exception:  # noqa: BLE001  whatever broke the reader, the waiters must hear of it
            pass
        finally:
            self._give_up(None)

    def _give_up(self, why: str | None) -> None:
        """The server is gone (or, with ``why``, no use): stop it, answer every waiter, close the socket."""
        if why is not None:
            _stop(self._process)
        with self._changed:
            self._dead = True
            message = self._why_dead() if why is None else f"nblaunch's launch server failed: {why}"
            for done in self._started.values():
                if not done.done():
                    done.set_exception(RuntimeError(message))
            self._changed.notify_all()
        self._ready.set()  # whoever waits for it learns the server is dead
        if why is None:  # the reader, which alone closes the socket: never a number reused under its read
            with self._send_lock:
                fdtable.close([self._fd])
        else:  # the server was killed: the reader meets its end of the socket closed, and closes ours
            raise RuntimeError(message)

    def _on_frame(self, kind: bytes, body: bytes) -> None:
        if kind == wire.SERVER_READY:
            self._ready.set()
            return
        with self._changed:
            if kind == wire.SERVER_STARTED:
                request_id, pid = pickle.loads(body)
                self._started.pop(request_id).set_result(pid)
            elif kind == wire.SERVER_FAILED:
                request_id, error = pickle.loads(body)
                self._started.pop(request_id).set_exception(RuntimeError(f"nblaunch's launch server could not "
                                                                         f"start a rank: {error}"))
            elif kind == wire.SERVER_EXITED:
                pid, code = pickle.loads(body)
                self._exit_codes[pid] = code
                self._changed.notify_all()

    def _why_dead(self) -> str:
        code = self._process.poll()
        return (f"nblaunch's launch server (pid {self._process.pid}) "
                + (f"exited with code {code}" if code is not None else "stopped answering")
                + ": see this process's stderr; the next launch starts a new one")


def _stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


class ServerChild:
    """How a rank forked by the server ends, for its ``WorkerProcess``: the server reaps it."""

    def __init__(self, server: LaunchServer, pid: int) -> None:
        self._server, self.pid = server, pid

    def poll(self) -> int | None:
        return self._server.exit_code(self.pid, wait=False)

    def wait(self) -> int:
        code = self._server.exit_code(self.pid, wait=True)
        assert code is not None
        return code


_server: LaunchServer | None = None
_server_lock = threading.Lock()


def launch_server() -> LaunchServer:
    """This process's launch server: the running one, or a new one."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive:
            _server = LaunchServer()
        return _server


def _forget_in_child() -> None:
    # A rank forked from here has no server: the socket is closed in it (fdtable), and a launch
    # made inside the rank starts a server of its own.
    global _server, _server_lock
    _server = None
    _server_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


class ServerStarter(Starter):
    """One process per rank, forked by this process's launch server."""

    def __init__(self) -> None:
        self._payload: Payload | None = None

    def environ_for_ranks(self, plan: LaunchPlan) -> dict[str, str]:
        launch_server()  # started now, on the caller's thread: torch imports there meanwhile
        return {}

    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        payload = self._payload = package((plan.request.function, plan.request.args))
        server = launch_server()
        here = dict(os.environ)  # the ranks' environment is this process's now, not the server's

        def start_one(settings: WorkerSettings) -> WorkerProcess:
            pipes = Pipes.open()
            try:
                pid = server.start_rank(pipes, dict(here, **settings.environ))
            except BaseException:
                fdtable.close(pipes.launcher_ends + pipes.worker_ends)
                raise
            worker = handle_for(pid, {settings.rank: pipes}, reaper=ServerChild(server, pid))
            send_payload(worker.ranks[0], settings, payload, memfds_on_the_socket=True)
            return worker

        return start_each_rank(plan, environ, start_one)

    def release(self) -> None:
        if self._payload is not None:
            fdtable.close(self._payload.fds)  # ranks that mapped the memory keep it
            self._payload = None
