"""The kernel's connection to one process of its launch server: the base, or a generation.

Each process of the server (``nblaunch.server``) answers on a socket of its own; a
:class:`ServerLink` reads it on a thread of its own and keeps what it said: ready or not, which
package a generation is importing and since when, what came of each, the ranks it forked and how
each ended. A rank's request waits for its answer; when the process dies every waiter hears why.

Example::

    link = ServerLink(fd, pid, "base", stop=popen.kill, reasons=popen.poll)
    link.wait_ready(300)
    pid = link.start_rank(pipes, environ, os.getcwd())   # forked there, on the rank's pipe ends
    link.exit_code(pid, wait=True)                        # once it has ended
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import pickle
import signal
import socket
import threading
import time
from typing import Callable

from nblaunch import proctree, wire
from nblaunch.launch.processes import fdtable
from nblaunch.launch.processes.processes import Pipes

_KILLED = -9  # the exit code of a rank whose server died before reporting it: it died with it


class ServerLink:
    """See the module. ``on_frame(link, kind, value)`` hears a generation's news (and the base's
    SERVER_GENERATION_STARTED, with the new socket's fd) on the reading thread."""

    def __init__(self, fd: int, pid: int, name: str, *, stop: Callable[[], None],
                 exit_status: Callable[[], int | None] = lambda: None,
                 on_frame: Callable[["ServerLink", bytes, object], None] | None = None) -> None:
        self.fd, self.pid, self.name = fd, pid, name
        self._stop = stop
        self._exit_status = exit_status
        self._on_frame = on_frame
        self._ready = threading.Event()
        self._changed = threading.Condition()
        self._started: dict[int, concurrent.futures.Future] = {}
        self._exit_codes: dict[int, int] = {}
        self._died_with: set[int] = set()  # ranks whose end it never reported: it died first
        self._ranks: set[int] = set()  # forked by it, not yet ended
        self._dead = False
        self._send_lock = threading.Lock()  # also keeps the socket open while a frame is written
        self._ids = itertools.count()
        self.loading: tuple[str, float] | None = None  # the package a generation imports now, and since when
        self.verdicts: dict[str, str] = {}  # what came of each package it imported
        self.started_at, self.ready_at = time.monotonic(), None  # ready_at - started_at: its imports' time
        self._paused_at: float | None = None  # stopped (SIGSTOP) since, while a launch runs alone
        self._pause_wanted = False  # a launch runs alone: stop it as soon as it may be stopped
        self._spoke = False  # it has said something: its lifeline is set, its inherited descriptors closed
        self._pausing = threading.Lock()  # pause and resume come from launches' threads and the reader's
        threading.Thread(target=self._read, name=f"nblaunch-{name}", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._dead

    @property
    def running(self) -> bool:
        """``alive``, asked of the machine now: its reader hears of a death a moment late (a
        process killed just before a launch, or a generation dying with its parent)."""
        return not self._dead and self._exit_status() is None and proctree.running(self.pid)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._dead

    @property
    def live_ranks(self) -> int:
        """Its ranks that run, and those asked for that it has not answered yet."""
        with self._changed:
            return len(self._ranks) + len(self._started)

    def wait_ready(self, timeout: float | None) -> bool:
        """True once it is ready; False if it died first, or ``timeout`` passed."""
        return self._ready.wait(timeout) and not self._dead

    def start_rank(self, pipes: Pipes, environ: dict[str, str], cwd: str,
                   standby: tuple[str, list[str], dict[str, str]] | None = None) -> int:
        """A process forked there on the rank ends of ``pipes``, in ``environ`` and ``cwd``;
        with ``standby`` (a device, "cpu" or a GPU's index; modules to import while it waits; the
        rank's own variables for those imports), on standby (``server/standby_rank``). Its pid;
        raises RuntimeError if it cannot (it died, or failed)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        request_id = next(self._ids)
        with self._changed:
            self._started[request_id] = done
        body = pickle.dumps((request_id, environ, cwd, standby), protocol=pickle.HIGHEST_PROTOCOL)
        self._send(wire.SERVER_START, body, pipes.worker_ends)
        pid = done.result()
        return pid

    def ask_generation(self, generation_id: int, environ: dict[str, str], names: list[str]) -> None:
        """The base only: fork a generation importing ``names`` under ``environ``."""
        self._send(wire.SERVER_GENERATION, pickle.dumps((generation_id, environ, names)), [])

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
        """Whether rank ``pid`` ended because this process died (its code was not reported)."""
        with self._changed:
            return pid in self._died_with

    def close(self) -> None:
        """Let it go: it sees EOF and exits (its ranks, if any, with it); so does the reader."""
        self.resume()  # a stopped process would not see the EOF
        with self._send_lock:
            if not self._dead:
                sock = socket.socket(fileno=self.fd)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                finally:
                    sock.detach()

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def pause(self) -> None:
        """Stop it (SIGSTOP) until ``resume``: it is importing while a launch wants the cores.
        A process that is ready is idle: it is not stopped (a launch may want a rank of it). Nor
        is one that has not said anything yet: stopped between its fork and its lifeline, it
        would outlive the kernel, holding the sockets of the process it was forked from (so a
        launch would never hear that its ranks died with their server); it is stopped when it
        first speaks, if a launch still runs alone then."""
        with self._pausing:
            self._pause_wanted = True
            if self._spoke:
                self._stop_now()

    def _stop_now(self) -> None:
        if self._paused_at is None and self.alive and not self._ready.is_set():
            self._signal(signal.SIGSTOP)
            self._paused_at = time.monotonic()

    def resume(self) -> None:
        """Let it go on; the time it stood still does not count as its package's import time."""
        with self._pausing:
            self._pause_wanted = False
            if self._paused_at is not None:
                self._signal(signal.SIGCONT)
                stood = time.monotonic() - self._paused_at
                self._paused_at = None
                loading = self.loading
                if loading is not None:
                    self.loading = (loading[0], loading[1] + stood)

    def _signal(self, signum: int) -> None:
        if not self.alive:
            return  # its pid may be another process's by now
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self, why: str) -> None:
        """Stop it now; whoever waits on it hears ``why``."""
        self._give_up(why)

    def why_dead(self) -> str:
        code = self._exit_status()
        return (f"nblaunch's launch server ({self.name}, pid {self.pid}) "
                + (f"exited with code {code}" if code is not None else "stopped answering")
                + ": see this process's stderr; the next launch starts a new one")

    def _send(self, kind: bytes, body: bytes, fds: list[int]) -> None:
        with self._send_lock:
            if self._dead:
                raise RuntimeError(self.why_dead())
            try:
                wire.write_frame_with_fds(self.fd, kind, body, fds)
            except OSError:
                pass  # it died: the reader finds out, and answers the request

    def _read(self) -> None:
        reader = wire.FrameReader()
        received: collections.deque[int] = collections.deque()  # descriptors ride on a frame's first bytes
        try:
            while chunk := _receive(self.fd):
                data, fds = chunk
                received.extend(fds)
                for kind, body in reader.feed(data):
                    self._on(kind, body, received)
        except Exception:  # noqa: BLE001  whatever broke the reader, the waiters must hear of it
            pass
        finally:
            self._give_up(None)

    def _on(self, kind: bytes, body: bytes, fds: collections.deque[int]) -> None:
        news: object = None  # what on_frame hears
        if not self._spoke:
            with self._pausing:
                self._spoke = True
                if self._pause_wanted and kind != wire.SERVER_READY:
                    self._stop_now()
        if kind == wire.SERVER_READY:
            self.ready_at = time.monotonic()
            self.loading = None
            self._ready.set()
            self.resume()  # stopped just as it got ready: idle now, and a launch may ask it
        elif kind == wire.SERVER_LOADING:
            self.loading = news = (pickle.loads(body), time.monotonic())
        elif kind == wire.SERVER_LOADED:
            package, verdict, _ = news = pickle.loads(body)
            self.verdicts[package] = verdict
            self.loading = None
        elif kind == wire.SERVER_GENERATION_STARTED:
            generation_id, pid = pickle.loads(body)
            news = (generation_id, pid, fds.popleft())
        with self._changed:
            if kind == wire.SERVER_STARTED:
                request_id, pid = pickle.loads(body)
                self._ranks.add(pid)
                self._started.pop(request_id).set_result(pid)
            elif kind == wire.SERVER_FAILED:
                request_id, error = pickle.loads(body)
                self._started.pop(request_id).set_exception(
                    RuntimeError(f"nblaunch's launch server could not start a rank: {error}"))
            elif kind == wire.SERVER_EXITED:
                pid, code = pickle.loads(body)
                self._ranks.discard(pid)
                self._exit_codes[pid] = code
                self._changed.notify_all()
        if self._on_frame is not None and kind in (wire.SERVER_READY, wire.SERVER_LOADING, wire.SERVER_LOADED,
                                                   wire.SERVER_GENERATION_STARTED):
            self._on_frame(self, kind, news)

    def _give_up(self, why: str | None) -> None:
        """It is gone (or, with ``why``, no use): stop it, answer every waiter, close the socket."""
        if why is not None:
            self._stop()
        with self._changed:
            self._dead = True
            message = self.why_dead() if why is None else f"nblaunch's launch server failed: {why}"
            for done in self._started.values():
                if not done.done():
                    done.set_exception(RuntimeError(message))
            self._ranks.clear()
            self._changed.notify_all()
        self._ready.set()  # whoever waits for it learns it is dead
        if why is None:  # the reader, which alone closes the socket: never a number reused under its read
            with self._send_lock:
                fdtable.close([self.fd])
        if self._on_frame is not None:
            self._on_frame(self, b"", None)  # b"": it is gone


def _receive(fd: int) -> tuple[bytes, list[int]] | None:
    """The next chunk read from the socket ``fd`` and the descriptors that came with it
    (registered at once: no fork of ours may copy them); None at EOF."""
    sock = socket.socket(fileno=fd)
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    finally:
        sock.detach()
    fdtable.hold(fds)
    return (data, list(fds)) if data else None
