"""The launch server: ``python -m nblaunch.launch.starting.server_process SOCKET_FD KERNEL_PID``.

A process that cannot fork its ranks (CUDA is started there, or ``start_method="spawn"``) has
them forked by this one: a fresh interpreter that imports torch, never touches CUDA, and imports
what each launch's ranks will import before forking them (``preload``), so later launches find
it loaded. It serves one kernel (or script) on one Unix socket, frames of ``nblaunch.wire``, a
single thread, ``SIGCHLD`` through a wakeup pipe (as Python's own ``forkserver``, which is not
used: it re-imports a script's ``__main__`` in each child and hides the child's pipes)::

    kernel -> server  SERVER_PRELOAD     (request id, modules wanted, the kernel's environ)
                      SERVER_START       (request id, environ, cwd); the rank's four pipe ends ride on it
    server -> kernel  SERVER_READY       torch is imported
                      SERVER_LOADING     a package's import begins (the kernel gives up on one that hangs)
                      SERVER_PRELOADED   (request id, {package: (verdict, seconds, what it read)},
                                          the packages' files, the variables the imports set)
                      SERVER_STARTED     (request id, pid), or SERVER_FAILED (request id, why)
                      SERVER_EXITED      (pid, exit code: -signal if killed), once reaped

A rank is forked with the kernel's environment and folder as the request gives them, not this
process's, then does what a spawned rank does (``worker.bootstrap.main_spawned``: its function
comes on its control socket). A package whose import starts CUDA or a thread, or reads a rank's
variables, leaves this process unfit to fork ranks: it answers, then exits, and the kernel starts
another without that package. EOF from the kernel ends it, and its ranks with it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import selectors
import signal
import socket
import sys
import time
import traceback
from typing import Iterator, NoReturn

from nblaunch import wire
from nblaunch.contract.variables import MKL_NUM_THREADS, OMP_NUM_THREADS, TORCH_WARM_POOL
from nblaunch.launch.starting.preload import OK, by_package, first_new, judge, stamps
from nblaunch.launch.starting.rank_imports import Wanted
from nblaunch.environ_watch import watched_environ
from nblaunch.worker import lifeline
from nblaunch.worker.bootstrap import main_spawned

_MAX_FDS_PER_READ = 253  # the kernel's limit per message (SCM_MAX_FD)
_PIPE_ENDS = 4  # stdout, stderr, events (write ends), control (the rank's end of a socketpair)
FIRST = ("torch", "torch.distributed")  # before it says it is ready


def main(argv: list[str]) -> NoReturn:
    socket_fd, kernel_pid = (int(a) for a in argv)
    lifeline.die_with_parent(kernel_pid)
    lifeline.name_process("nblaunch-server")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the kernel to handle
    # torch's compile workers started by an import would make this a process with threads and
    # children of its own: the ranks, forked from here, start them if they compile.
    os.environ.setdefault(TORCH_WARM_POOL, "0")
    with watched_environ() as first:
        for module in FIRST:
            __import__(module)
    # What torch's import read, as the kernel's environment had it (the server sets these two itself).
    read = {name: os.environ.get(name) for name in first.read - {"*", "PYTHONPATH", TORCH_WARM_POOL}}
    server = Server(socket.socket(fileno=socket_fd), dict(first.written))
    server.send(wire.SERVER_READY, (read, stamps(["torch"])))
    server.serve_forever()


class Server:
    """The launch server's loop (see the module). ``added``: what its imports set in
    ``os.environ``, which ranks get unless their environment says otherwise."""

    def __init__(self, connection: socket.socket, added: dict[str, str]) -> None:
        self.added = added
        self._connection = connection
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
        self._failed: set[str] = set()  # modules that would not import by their name: not tried again

    def send(self, kind: bytes, body: object = None) -> None:
        wire.write_frame(self._connection.fileno(), kind, b"" if body is None else pickle.dumps(body))

    def serve_forever(self) -> NoReturn:
        while True:
            for key, _ in self._selector.select(None):
                if key.fd == self._wake_read:
                    self._reap()
                else:
                    self._read()

    def _read(self) -> None:
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
            elif kind == wire.SERVER_PRELOAD:
                self._preload(*pickle.loads(body))

    # ------------------------------------------------------------------ imports
    def _preload(self, request_id: int, wanted: list[Wanted], environ: dict[str, str]) -> None:
        """Import ``wanted`` under the kernel's ``environ``, one package at a time (see the module)."""
        os.environ.clear()
        os.environ.update({**self.added, **environ})  # a library reads variables at import
        verdicts: dict[str, tuple[str, float, dict[str, str | None]]] = {}
        with _one_intra_op_thread():
            for package, modules in by_package(wanted):
                modules = [(name, names) for name, names in modules
                           if (names or name not in sys.modules) and name not in self._failed]
                if not modules:
                    continue
                self._reap()  # a rank of another launch that ended meanwhile is told now
                self.send(wire.SERVER_LOADING, package)
                began, shown = time.monotonic(), first_new(package, modules)
                judged = judge(modules, strict=True)
                verdict, watch = judged.verdict, judged.environ
                os.environ.update(watch.written)  # for the packages after it, and the ranks
                self.added.update(watch.written)
                self._failed.update(judged.failed)
                read = {name: environ.get(name) for name in watch.read if name != "*"}
                verdicts[shown] = (verdict, time.monotonic() - began, read)
                if verdict != OK and not verdict.startswith("raised"):
                    self.send(wire.SERVER_PRELOADED, (request_id, verdicts, {}, dict(self.added)))
                    os._exit(0)  # no rank may come from here any more: the kernel starts another
        files = stamps({name.partition(".")[0] for name, (verdict, _, _) in verdicts.items() if verdict == OK})
        self.send(wire.SERVER_PRELOADED, (request_id, verdicts, files, dict(self.added)))

    # ------------------------------------------------------------------ ranks
    def _start_rank(self, request_id: int, environ: dict[str, str], cwd: str) -> None:
        ends = [self._received.popleft() for _ in range(_PIPE_ENDS)]
        environ = dict(environ, **{k: v for k, v in self.added.items() if k not in environ})
        others = [self._connection.fileno(), self._wake_read, self._wake_write, *self._received]
        try:
            pid = _fork(lambda: _become_rank(ends, environ, cwd), others, self._selector)
        except OSError as error:  # no process to be had (pids.max, memory): this launch fails, not others
            self.send(wire.SERVER_FAILED, (request_id, repr(error)))
            return
        finally:
            for fd in ends:
                os.close(fd)
        self._ranks.add(pid)
        self.send(wire.SERVER_STARTED, (request_id, pid))

    def _reap(self) -> None:
        """Reap every rank that has exited and tell the kernel its exit code. Only ranks: a
        process an import started is not ours to reap."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        for child in list(self._ranks):
            try:
                pid, status = os.waitpid(child, os.WNOHANG)
            except ChildProcessError:
                pid, status = child, 0  # reaped already: nothing to say but that it ended
            if pid != 0:
                self._ranks.discard(child)
                self.send(wire.SERVER_EXITED, (child, os.waitstatus_to_exitcode(status)))


def _fork(child, others: list[int], selector: selectors.BaseSelector) -> int:  # noqa: ANN001  a callable
    """Fork ``child``; in it, the server's own descriptors (``others``) are closed first."""
    sys.stdout.flush()  # nothing of the server's may reach a rank's pipes later
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            selector.close()
            for fd in others:  # the server's socket and pipes, other ranks' ends: never a rank's
                os.close(fd)
            child()
        except BaseException:  # before the rank could report anything itself: on its stderr
            text = "nblaunch: the launch server could not start this rank:\n" + traceback.format_exc()
            os.write(2, text.encode("utf-8", "backslashreplace"))
        finally:
            os._exit(70)
    return pid


def _become_rank(ends: list[int], environ: dict[str, str], cwd: str) -> NoReturn:
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
    main_spawned([str(control), str(events), str(os.getppid())])


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """An import that runs a torch op would start GNU OpenMP's pool for this thread, and every
    rank forked from it would hang in its first parallel op (see ``launch/processes/
    forking_thread``): with one thread no pool is made. The count is put back for the ranks."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    if threads is not None:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(threads)


if __name__ == "__main__":
    main(sys.argv[1:])
