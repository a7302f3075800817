"""The launch server: ranks forked from a process that imported torch but never touched CUDA.

A kernel that initialised CUDA (or asked for ``start_method="spawn"``) cannot fork its ranks: a
forked child's CUDA is broken. A fresh interpreter per rank works but costs seconds each launch
(``import torch``). So the kernel starts this server once (``launch/starting/server_starter``):
``python -m nblaunch.worker.fork_server SOCKET_FD KERNEL_PID``. It imports torch and nblaunch's
worker, says it is ready, then forks one child per rank the kernel asks for; each child becomes a
rank exactly as a spawned one (``bootstrap.main_spawned``: the function and its arguments come on
its control socket), with the kernel's current environment and folder, not the server's.

The protocol, frames of ``nblaunch.wire`` on one Unix socket (as Python's own ``forkserver`` does,
a single thread, ``SIGCHLD`` through a wakeup pipe)::

    kernel -> server  SERVER_START  pickled (request id, environ, cwd); the rank's four pipe ends ride on it
    server -> kernel  SERVER_READY  once the imports are done
                      SERVER_STARTED  pickled (request id, pid)
                      SERVER_EXITED   pickled (pid, exit code: -signal if killed), once reaped

It dies with the kernel (the death signal, and EOF on the socket), and its ranks die with it. Once
idle a while after its first ranks, it imports what a first training step needs (``torch._dynamo``,
nblaunch's ``Accelerator``), so later ranks inherit it.
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
from typing import NoReturn

from nblaunch import wire
from nblaunch.contract.variables import MKL_NUM_THREADS, OMP_NUM_THREADS
from nblaunch.preimport import import_for_ranks
from nblaunch.worker import lifeline
from nblaunch.worker.bootstrap import main_spawned

_MAX_FDS_PER_READ = 253  # the kernel's limit per message (SCM_MAX_FD)
_FIRST = ("torch", "torch.distributed")  # before it says it is ready
# A first optimizer's import, about a second: done once the server has been idle a while after its
# first ranks (an import cannot be cut short: a launch asked for meanwhile waits for it), never
# before a first launch (which it would slow down), so later ranks inherit it.
_WHEN_IDLE = ("torch._dynamo", "nblaunch.training")  # the Accelerator's modules too: a rank unpickling it
_IDLE_BEFORE_IMPORTING_S = 1.0
_PIPE_ENDS = 4  # stdout, stderr, events (write ends), control (the rank's end of a socketpair)


def main(argv: list[str]) -> NoReturn:
    """``python -m nblaunch.worker.fork_server SOCKET_FD KERNEL_PID``."""
    socket_fd, kernel_pid = (int(a) for a in argv)
    lifeline.die_with_parent(kernel_pid)
    lifeline.name_process("nblaunch-server")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the kernel to handle
    # torch's compile workers started by an import would make this a process with threads and
    # children of its own: the ranks, forked from here, start them if they compile.
    os.environ.setdefault("TORCH_WARM_POOL", "0")
    connection = socket.socket(fileno=socket_fd)
    added: dict[str, str] = {}  # what the imports set in os.environ: the ranks get it too
    for module in _FIRST:
        added.update(import_for_ranks(module))
    wire.write_frame(socket_fd, wire.SERVER_READY)
    _serve(connection, added, list(_WHEN_IDLE))


def _serve(connection: socket.socket, added: dict[str, str], later: list[str]) -> NoReturn:
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup pipe says it; the loop reaps
    selector = selectors.DefaultSelector()
    selector.register(connection, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    reader = wire.FrameReader()
    received: collections.deque[int] = collections.deque()  # pipe ends not yet handed to a rank
    children: set[int] = set()
    served = False
    while True:
        idle = served and not children  # after a launch, before the next: nobody waits on this
        ready = selector.select(_IDLE_BEFORE_IMPORTING_S if idle and later else None)
        if not ready and idle and later:
            try:
                added.update(import_for_ranks(later.pop(0)))
            except Exception:  # an optimisation only: the ranks import it themselves if they need it
                later.clear()
            continue
        for key, _ in ready:
            if key.fd == wake_read:
                _drain(wake_read)
                children -= _reap(connection.fileno(), children)
                continue
            chunk, fds, flags, _ = socket.recv_fds(connection, 1 << 16, _MAX_FDS_PER_READ)
            if not chunk:
                os._exit(0)  # the kernel is gone: its ranks go with this process (their death signal)
            if flags & socket.MSG_CTRUNC:  # descriptors dropped (this process has no room): whose is unknown
                os.write(2, b"nblaunch launch server: descriptors were dropped (too many open files); it stops\n")
                os._exit(1)
            received.extend(fds)
            for kind, body in reader.feed(chunk):
                if kind != wire.SERVER_START:
                    continue
                ends = [received.popleft() for _ in range(_PIPE_ENDS)]
                request_id, environ, cwd = pickle.loads(body)
                environ = dict(environ, **{k: v for k, v in added.items() if k not in environ})
                others = [connection.fileno(), wake_read, wake_write, *received]  # not the rank's
                try:
                    pid = _fork_rank(ends, environ, cwd, others, selector)
                except OSError as error:  # no process to be had (pids.max, memory): this launch fails, not others
                    for fd in ends:
                        os.close(fd)
                    wire.write_frame(connection.fileno(), wire.SERVER_FAILED, pickle.dumps((request_id, repr(error))))
                    continue
                children.add(pid)
                wire.write_frame(connection.fileno(), wire.SERVER_STARTED, pickle.dumps((request_id, pid)))
                served = True


def _fork_rank(ends: list[int], environ: dict[str, str], cwd: str, others: list[int],
               selector: selectors.BaseSelector) -> int:
    """Fork one rank on ``ends`` (stdout, stderr, events, control); returns its pid here."""
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
            _become_rank(ends, environ, cwd)
        except BaseException:  # before the rank could report anything itself: on its stderr pipe
            text = "nblaunch: the launch server could not start this rank:\n" + traceback.format_exc()
            for fd in (ends[1], 2):  # its pipe, or fd 2 once the pipe is there
                try:
                    os.write(fd, text.encode("utf-8", "backslashreplace"))
                    break
                except OSError:
                    continue
        finally:
            os._exit(70)
    for fd in ends:
        os.close(fd)
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


def _reap(fd: int, children: set[int]) -> set[int]:
    """Every rank of ``children`` that has exited: reaped, and its exit code sent to the kernel;
    their pids. Only ranks: a child an import started is not ours to reap."""
    reaped = set()
    for child in children:
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            pid, status = child, 0  # reaped already: nothing to say but that it ended
        if pid == 0:
            continue
        reaped.add(child)
        wire.write_frame(fd, wire.SERVER_EXITED, pickle.dumps((child, os.waitstatus_to_exitcode(status))))
    return reaped


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
