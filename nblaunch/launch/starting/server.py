"""This process's launch server (``server_process``), from this side: one process, started when a
launch first needs it, used by every later launch while it fits, and replaced whole when it no
longer does (a package it imported was installed anew, a variable its imports read has changed,
or it died). A server with ranks still running is let go only once they have ended.

:class:`LaunchServer` is the link to one server process: a thread reads what it says (ready, the
package it imports now, what came of a preload, the ranks it forked and how each ended), and a
request waits for its answer; when the process dies every waiter hears why.

Example::

    server = fitting_server(dict(os.environ))      # the running one, or a new one
    server.preload(wanted, dict(os.environ))       # {package: verdict}
    pid = server.start_rank(pipes, environ, os.getcwd())
    server.exit_code(pid, wait=True)               # once it has ended
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

from nblaunch import proctree, wire
from nblaunch.launch.processes import fdtable
from nblaunch.launch.processes.forking_thread import run_on_forking_thread
from nblaunch.launch.processes.processes import PACKAGE_ROOT, Pipes
from nblaunch.launch.starting.preload import OK, Stamp, changed
from nblaunch.launch.starting.rank_imports import Wanted
from nblaunch.per_process import per_process

READY_BACKSTOP_S = 300.0  # importing torch takes seconds; a server that never gets there is broken
PACKAGE_HANGS_S = 60.0  # a package the server has been importing this long is given up (and the server)
_KILLED = -9  # the exit code of a rank whose server died before reporting it: it died with it


class ServerLost(RuntimeError):
    """The server died, or was given up (``hung``: the package whose import never finished)."""

    def __init__(self, message: str, hung: str | None = None) -> None:
        super().__init__(message)
        self.hung = hung


class LaunchServer:
    """One launch server process (see the module). Thread-safe."""

    def __init__(self) -> None:
        # Registered before anything can fork (a launch on another thread, a DataLoader): a copy
        # of the server's end in any child would hide the server's death from the reader for good.
        self.fd, theirs = fdtable.new_socketpair()
        environ = dict(os.environ)
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, environ.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "nblaunch.launch.starting.server_process", str(theirs), str(os.getpid())]

        def start() -> subprocess.Popen:  # on the forking thread: the server's death signal is tied to it
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=(theirs,), env=environ,
                                    start_new_session=True)  # not in the kernel's group: interrupts are the kernel's

        try:
            self._process = run_on_forking_thread(start, undo=_stop)
        except BaseException:
            fdtable.close([self.fd])
            raise
        finally:
            fdtable.close([theirs])
        self.pid = self._process.pid
        self.started_at, self.ready_at = time.monotonic(), None
        self._ready = threading.Event()
        self._changed = threading.Condition()
        self._answers: dict[int, concurrent.futures.Future] = {}
        self._exit_codes: dict[int, int] = {}
        self._died_with: set[int] = set()  # ranks whose end it never reported: it died first
        self._ranks: set[int] = set()  # forked by it, not yet ended
        self._dead = False
        self._send_lock = threading.Lock()  # also keeps the socket open while a frame is written
        self._ids = itertools.count()
        self.loading: tuple[str, float] | None = None  # the package it imports now, and since when
        self.loaded: dict[str, float] = {}  # the packages it imported, and what each took
        self._read: dict[str, str | None] = {}  # what its imports read from the kernel's environment
        self._files: dict[str, Stamp | None] = {}  # the files of what it imported
        threading.Thread(target=self._reader, name="nblaunch-launch-server", daemon=True).start()

    # ------------------------------------------------------------------ state
    @property
    def alive(self) -> bool:
        """Not known dead, and running now: its reader hears of a death a moment late."""
        return not self._dead and self._process.poll() is None and proctree.running(self.pid)

    @property
    def live_ranks(self) -> int:
        with self._changed:
            return len(self._ranks) + len(self._answers)

    def unfit(self, environ: dict[str, str]) -> str | None:
        """Why the next launch's ranks must not come from it, or None."""
        if not self.alive:
            return "it is not running"
        with self._changed:
            files, read = dict(self._files), dict(self._read)
        anew = changed(files)
        if anew:
            return f"{anew[0]}, which it had imported, was installed anew"
        moved = sorted(name for name, value in read.items() if environ.get(name) != value)
        if moved:
            return f"{moved[0]}, which its imports read, has changed"
        return None

    def wait_gone(self, timeout: float = 10.0) -> None:
        """Wait until its process has exited (it does after a verdict that leaves it unfit)."""
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            _stop(self._process)

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout) and not self._dead

    # ------------------------------------------------------------------ requests
    def preload(self, wanted: list[Wanted], environ: dict[str, str]) -> dict[str, str]:
        """Import ``wanted`` there under ``environ``; each package's verdict. Raises ServerLost
        if it dies first, or hangs on a package (it is then stopped)."""
        if not self.wait_ready(READY_BACKSTOP_S):
            self._give_up(self.why_dead() if self._dead else f"it was not ready within {READY_BACKSTOP_S:g} s")
        answer = self._ask(wire.SERVER_PRELOAD, lambda request: (request, wanted, environ), [])
        while True:
            try:
                verdicts, _ = answer.result(timeout=1.0)
                return verdicts
            except concurrent.futures.TimeoutError:
                loading = self.loading
                if loading is not None and time.monotonic() - loading[1] > PACKAGE_HANGS_S:
                    self._give_up(f"importing {loading[0]} did not finish within {PACKAGE_HANGS_S:g} s", loading[0])

    def preload_soon(self, wanted: list[Wanted], environ: dict[str, str]) -> None:
        """Ask it to import ``wanted`` and do not wait (a later request waits behind it)."""
        self._ask(wire.SERVER_PRELOAD, lambda request: (request, wanted, environ), [])

    def start_rank(self, pipes: Pipes, environ: dict[str, str], cwd: str) -> int:
        """A process forked there on the rank ends of ``pipes``, in ``environ`` and ``cwd``; its
        pid. Raises ServerLost if it cannot (it died, or failed)."""
        if not self.wait_ready(READY_BACKSTOP_S):
            self._give_up(self.why_dead() if self._dead else f"it was not ready within {READY_BACKSTOP_S:g} s")
        answer = self._ask(wire.SERVER_START, lambda request: (request, environ, cwd), pipes.worker_ends)
        return answer.result()

    def exit_code(self, pid: int, wait: bool, timeout: float | None = None) -> int | None:
        """The exit code of rank ``pid`` (-signal if killed), once reaped there; None if it runs
        and ``wait`` is False (or ``timeout`` seconds passed)."""
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: pid in self._exit_codes or self._dead, timeout)
            if pid in self._exit_codes:
                return self._exit_codes.pop(pid)
            if self._dead:
                self._died_with.add(pid)
                return _KILLED
            return None

    def died_with_it(self, pid: int) -> bool:
        """Whether rank ``pid`` ended because the server died (its code was never reported)."""
        with self._changed:
            return pid in self._died_with

    def close(self) -> None:
        """Let it go: it sees EOF and exits (its ranks, if any, with it)."""
        with self._send_lock:
            if not self._dead:
                sock = socket.socket(fileno=self.fd)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                finally:
                    sock.detach()

    def why_dead(self) -> str:
        code = self._process.poll()
        return (f"nblaunch's launch server (pid {self.pid}) "
                + (f"exited with code {code}" if code is not None else "stopped answering")
                + ": see this process's stderr; the next launch starts a new one")

    def _ask(self, kind: bytes, body, fds: list[int]) -> concurrent.futures.Future:  # noqa: ANN001
        """Send a request (``body(request id)``); the future its answer completes."""
        answer: concurrent.futures.Future = concurrent.futures.Future()
        request = next(self._ids)
        with self._changed:  # registered where _give_up answers every waiter: never left unanswered
            if self._dead:
                raise ServerLost(self.why_dead())
            self._answers[request] = answer
        with self._send_lock:
            try:
                wire.write_frame_with_fds(self.fd, kind, pickle.dumps(body(request), protocol=pickle.HIGHEST_PROTOCOL),
                                          fds)
            except OSError:
                pass  # it died: the reader finds out, and answers the request
        return answer

    # ------------------------------------------------------------------ what it says
    def _reader(self) -> None:
        reader = wire.FrameReader()
        try:
            while chunk := os.read(self.fd, 1 << 16):
                for kind, body in reader.feed(chunk):
                    self._on(kind, pickle.loads(body) if body else None)
        except Exception:  # noqa: BLE001  whatever broke the reader, the waiters must hear of it
            pass
        finally:
            self._give_up(None)

    def _on(self, kind: bytes, news: object) -> None:
        if kind == wire.SERVER_READY:
            read, files = news
            with self._changed:
                self._read.update(read)
                self._files.update(files)
            self.ready_at = time.monotonic()
            self._ready.set()
        elif kind == wire.SERVER_LOADING:
            self.loading = (news, time.monotonic())
        elif kind == wire.SERVER_PRELOADED:
            request, verdicts, files, written = news
            self.loading = None
            with self._changed:
                for package, (verdict, seconds, read) in verdicts.items():
                    if verdict == OK:
                        self.loaded[package] = seconds
                        self._read.update(read)
                self._files.update(files)
                answer = self._answers.pop(request)
            answer.set_result(({p: v for p, (v, _, _) in verdicts.items()}, written))
        elif kind in (wire.SERVER_STARTED, wire.SERVER_FAILED, wire.SERVER_EXITED):
            with self._changed:
                if kind == wire.SERVER_STARTED:
                    request, pid = news
                    self._ranks.add(pid)
                    self._answers.pop(request).set_result(pid)
                elif kind == wire.SERVER_FAILED:
                    request, error = news
                    self._answers.pop(request).set_exception(
                        ServerLost(f"nblaunch's launch server could not start a rank: {error}"))
                else:
                    pid, code = news
                    self._ranks.discard(pid)
                    self._exit_codes[pid] = code
                    self._changed.notify_all()

    def _give_up(self, why: str | None, hung: str | None = None) -> None:
        """It is gone (or, with ``why``, no use: stopped, and ServerLost raised): answer every waiter."""
        if why is not None:
            _stop(self._process)
        with self._changed:
            self._dead = True
            message = self.why_dead() if why is None else f"nblaunch's launch server failed: {why}"
            for answer in self._answers.values():
                if not answer.done():
                    answer.set_exception(ServerLost(message, hung))
            self._answers.clear()
            self._ranks.clear()
            self._changed.notify_all()
        self._ready.set()  # whoever waits for it learns it is dead
        if why is None:  # the reader, which alone closes the socket: never a number reused under its read
            with self._send_lock:
                fdtable.close([self.fd])
        else:
            raise ServerLost(message, hung)


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

    def ended_because(self) -> str | None:
        if self._server.died_with_it(self.pid):
            return (f"its launch server (pid {self._server.pid}) died, and the ranks it had started with it; the "
                    "next launch starts a new one")
        return None


def _stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


class _Servers:
    """This process's launch servers: the one launches use now, and those let go once their
    ranks have ended. A rank forked from here has none: the sockets are closed in it (fdtable)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: LaunchServer | None = None
        self.replaced_because: str | None = None  # why the last server was replaced
        self._leaving: list[LaunchServer] = []

    def fitting(self, environ: dict[str, str]) -> LaunchServer:
        with self.lock:
            for server in [s for s in self._leaving if not (s.alive and s.live_ranks)]:
                server.close()
                self._leaving.remove(server)
            current = self.current
            why = None if current is None else current.unfit(environ)
            if current is not None and why is None:
                return current
            if current is not None:
                self.replaced_because = why
                if current.alive:
                    self._leaving.append(current)
            self.current = LaunchServer()
            return self.current


servers = per_process(_Servers)


def fitting_server(environ: dict[str, str]) -> LaunchServer:
    """The launch server the next launch's ranks come from: the running one if it fits
    ``environ`` (this process's now), else a new one (see the module)."""
    return servers().fitting(environ)


def running_server() -> LaunchServer | None:
    """This process's launch server if one runs; never starts one."""
    current = servers().current
    return current if current is not None and current.alive else None

