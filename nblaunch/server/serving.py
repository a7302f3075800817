"""The loop every process of the launch server runs: fork a rank when the kernel asks for one,
reap it, report its exit; the base also forks generations (``server/generation``).

Frames of ``nblaunch.wire`` on one Unix socket per process (as Python's own ``forkserver``: a
single thread, ``SIGCHLD`` through a wakeup pipe)::

    kernel -> server  SERVER_START       (request id, environ, cwd, standby: (device, names, the
                                         rank's variables) or None);
                                         the rank's four pipe ends ride on it
                      SERVER_GENERATION  (generation id, environ, names)          base only
    server -> kernel  SERVER_STARTED     (request id, pid)   or SERVER_FAILED (request id, why)
                      SERVER_EXITED      (pid, exit code: -signal if killed), once reaped
                      SERVER_GENERATION_STARTED (generation id, pid); its socket's other end rides on it

A rank is forked with the kernel's environment and folder as the request gives them, not this
process's; it then does what a spawned rank does (``worker.bootstrap.main_spawned``: the function
comes on its control socket). EOF from the kernel ends the process, and its ranks with it.
"""

from __future__ import annotations

import collections
import os
import pickle
import selectors
import signal
import socket
import sys
import traceback
from typing import Callable, NoReturn

from nblaunch import wire
from nblaunch.contract.variables import MKL_NUM_THREADS, OMP_NUM_THREADS
from nblaunch.server.standby_rank import wait_for_a_launch
from nblaunch.worker.bootstrap import main_spawned

_MAX_FDS_PER_READ = 253  # the kernel's limit per message (SCM_MAX_FD)
_PIPE_ENDS = 4  # stdout, stderr, events (write ends), control (the rank's end of a socketpair)

# What a forked generation runs: (its socket's fd, generation id, environ, names, the variables
# imports set so far). Given by the base (``server/base_process``), which alone makes generations.
GenerationEntry = Callable[[int, int, dict, list, dict], NoReturn]


class Server:
    """One process of the launch server, serving the kernel on ``connection``.

    ``added``: the variables this process's imports set, which ranks get unless their
    environment says otherwise. ``make_generation``: the base's entry for a generation child.
    """

    def __init__(self, connection: socket.socket, added: dict[str, str],
                 make_generation: GenerationEntry | None = None) -> None:
        self.added = added
        self._connection = connection
        self._make_generation = make_generation
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        signal.set_wakeup_fd(self._wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup pipe says it; the loop reaps
        self._selector = selectors.DefaultSelector()
        self._selector.register(connection, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._reader = wire.FrameReader()
        self._received: collections.deque[int] = collections.deque()  # pipe ends not yet handed to a rank
        self._ranks: set[int] = set()
        self._generations: set[int] = set()

    @property
    def fd(self) -> int:
        return self._connection.fileno()

    def send(self, kind: bytes, body: object = None, fds: list[int] | None = None) -> None:
        data = b"" if body is None else pickle.dumps(body)
        if fds:
            wire.write_frame_with_fds(self.fd, kind, data, fds)
        else:
            wire.write_frame(self.fd, kind, data)

    def serve_forever(self) -> NoReturn:
        while True:
            self.poll(None)

    def poll(self, timeout: float | None) -> None:
        """Handle what is ready within ``timeout`` seconds (None: until something is)."""
        for key, _ in self._selector.select(timeout):
            if key.fd == self._wake_read:
                _drain(self._wake_read)
                self._reap()
                continue
            chunk, fds, flags, _ = socket.recv_fds(self._connection, 1 << 16, _MAX_FDS_PER_READ)
            if not chunk:
                os._exit(0)  # the kernel is gone: the ranks go with this process (their death signal)
            if flags & socket.MSG_CTRUNC:  # descriptors dropped (this process has no room): whose is unknown
                os.write(2, b"nblaunch launch server: descriptors were dropped (too many open files); it stops\n")
                os._exit(1)
            self._received.extend(fds)
            for kind, body in self._reader.feed(chunk):
                if kind == wire.SERVER_START:
                    self._start_rank(*pickle.loads(body))
                elif kind == wire.SERVER_GENERATION and self._make_generation is not None:
                    self._start_generation(*pickle.loads(body))

    # ------------------------------------------------------------------ ranks
    def _start_rank(self, request_id: int, environ: dict[str, str], cwd: str,
                    standby: tuple[str, list[str], dict[str, str]] | None) -> None:
        ends = [self._received.popleft() for _ in range(_PIPE_ENDS)]
        environ = dict(environ, **{k: v for k, v in self.added.items() if k not in environ})
        try:
            pid = self._fork(lambda: _become_rank(ends, environ, cwd, standby))
        except OSError as error:  # no process to be had (pids.max, memory): this launch fails, not others
            self.send(wire.SERVER_FAILED, (request_id, repr(error)))
            return
        finally:
            for fd in ends:
                os.close(fd)
        self._ranks.add(pid)
        self.send(wire.SERVER_STARTED, (request_id, pid))

    def _start_generation(self, generation_id: int, environ: dict[str, str], names: list[str]) -> None:
        mine, theirs = socket.socketpair()
        try:
            pid = self._fork(lambda: self._make_generation(theirs.fileno(), generation_id, environ, names,
                                                           dict(self.added)), also_close=[mine.fileno()])
        except OSError:
            mine.close()
            theirs.close()
            return  # the kernel hears nothing: its next launch's ranks come from this process
        theirs.close()
        self._generations.add(pid)
        self.send(wire.SERVER_GENERATION_STARTED, (generation_id, pid), fds=[mine.fileno()])
        mine.close()

    def _fork(self, child: Callable[[], NoReturn], also_close: tuple[int, ...] | list[int] = ()) -> int:
        """Fork ``child``; in it, this process's own descriptors (and ``also_close``) are closed first."""
        sys.stdout.flush()  # nothing of the server's may reach a child's pipes later
        sys.stderr.flush()
        others = [self.fd, self._wake_read, self._wake_write, *self._received, *also_close]
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                self._selector.close()
                for fd in others:  # the server's socket and pipes, other ranks' ends: never a child's
                    os.close(fd)
                child()
            except BaseException:  # before the child could report anything itself: on its stderr
                text = "nblaunch: the launch server could not start this process:\n" + traceback.format_exc()
                os.write(2, text.encode("utf-8", "backslashreplace"))
            finally:
                os._exit(70)
        return pid

    def _reap(self) -> None:
        """Reap every child that has exited; report each rank's exit code to the kernel. Only
        our children: a process an import started is not ours to reap."""
        for child in list(self._ranks | self._generations):
            try:
                pid, status = os.waitpid(child, os.WNOHANG)
            except ChildProcessError:
                pid, status = child, 0  # reaped already: nothing to say but that it ended
            if pid == 0:
                continue
            if child in self._ranks:
                self._ranks.discard(child)
                self.send(wire.SERVER_EXITED, (child, os.waitstatus_to_exitcode(status)))
            self._generations.discard(child)


def _become_rank(ends: list[int], environ: dict[str, str], cwd: str,
                 standby: tuple[str, list[str], dict[str, str]] | None) -> NoReturn:
    stdout, stderr, events, control = ends
    os.setpgid(0, 0)  # a process group of its own, as every rank
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    try:
        os.chdir(cwd)
    except OSError as error:  # the kernel's folder is gone: the rank still runs, and says so
        os.write(2, f"nblaunch: the rank could not enter {cwd!r} ({error}); it runs in {os.getcwd()!r}\n".encode())
    os.environ.clear()  # the kernel's environment as it is now, not the server's from its start
    os.environ.update(environ)
    torch = sys.modules.get("torch")
    for name in (OMP_NUM_THREADS, MKL_NUM_THREADS):  # torch read them when the server imported it
        if torch is not None and environ.get(name, "").isdigit():
            torch.set_num_threads(int(environ[name]))
    parent = os.getppid()
    if standby is not None:  # forked ahead of its launch: ready its device, wait to be claimed
        wait_for_a_launch(control, events, *standby)
    main_spawned([str(control), str(events), str(parent)])


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
