"""The launcher's handle on a worker process and on each rank's pipes; forking a process.

Each rank gets three pipes and a socket: its stdout and stderr (fds 1 and 2, so C-level output
is caught too), an event pipe (results, errors, metrics, progress, stacks) and a control socket
(the spawn payload, stack-dump requests, a warm rank's calls with their memfds; EOF tells the
rank its launcher is gone). Each rank leads a process group of its own,
so stopping it also stops the processes it started (DataLoader workers).

The ways of starting a process (``fork``, ``spawn``, ``xla_host``) build on what is here.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import re
import signal
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Protocol, runtime_checkable

from nblaunch import proctree, wire
from nblaunch.launch.processes import fdtable
from nblaunch.launch.processes.forking_thread import run_on_forking_thread
from nblaunch.launch.processes.packing import Payload

# Python 3.12+ warns at every fork in a threaded process; a Jupyter kernel always has threads.
# The child runs only our bootstrap and the user's function, the same bet torch.multiprocessing's
# fork makes. One filter, for warnings raised from this module only, added once at import: a
# catch_warnings() around each fork swapped the process-wide filters from launch threads, and
# two concurrent launches left the user's filters changed for good.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=re.escape(__name__) + "$")

# The folder nblaunch is in: a fresh interpreter of ours (a spawned rank, the launch server's base)
# finds it on its path whether or not nblaunch is installed.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_F_SETPIPE_SZ = 1031  # Linux: bigger pipes mean fewer wake-ups for chatty ranks and big results
_PIPE_SIZE = 1 << 20


@dataclass
class RankPipes:
    """The launcher's ends of one rank's pipes."""

    rank: int
    stdout_fd: int
    stderr_fd: int
    event_fd: int
    control_fd: int  # a Unix socket: it can carry memfds to the rank (see send)
    control_link: str  # what /proc/<pid>/fd shows for the rank's end of the control socket
    payload_sender: threading.Thread | None = None  # spawned ranks: still writing the function
    # Frames to the rank come from the supervisor (stack requests) and a warm pool's caller
    # (calls): one writer at a time, so frames never interleave.
    control_lock: threading.Lock = field(default_factory=threading.Lock)

    def request_stacks(self) -> None:
        if self.payload_sender is not None and self.payload_sender.is_alive():
            return  # the control pipe is still carrying the payload; the rank has not started
        self.send(wire.DUMP_STACKS)

    def send(self, kind: bytes, body: bytes = b"", shared: Payload | None = None) -> bool:
        """One frame to the rank, after the spawn payload if that is still being written; False
        if the rank is gone. ``shared``: the memfds ``body``'s pickle refers to, sent first (a
        SHARED frame carrying them), so the rank maps them as a spawned rank maps its payload's."""
        if self.payload_sender is not None:
            self.payload_sender.join()
        try:
            with self.control_lock:
                if shared is not None and shared.fds:
                    note = pickle.dumps((shared.fds, shared.buffers), protocol=pickle.HIGHEST_PROTOCOL)
                    wire.write_frame_with_fds(self.control_fd, wire.SHARED, note, shared.fds)
                wire.write_frame(self.control_fd, kind, body)
            return True
        except OSError:
            return False


class Reaper(Protocol):
    def poll(self) -> int | None: ...

    def wait(self) -> int: ...


@runtime_checkable
class ExplainsEnd(Protocol):
    """A reaper that may know why its process ended beyond its exit code."""

    def ended_because(self) -> str | None: ...


@dataclass
class WorkerProcess:
    """The launcher's handle on one process it started, and the ranks that process hosts.

    Fork and spawn start one process per rank. On XLA one host process runs ``xmp.spawn``,
    whose processes (one per chip) run one thread per device: many ranks, one process group.
    """

    pid: int
    ranks: list[RankPipes]
    exit_fd: int | None  # a pidfd: readable once the process has exited (None where unsupported)
    # What reaps it when it is not a child forked here: its Popen (spawned), the launch server
    # (a rank it forked). Anything with poll() and wait() returning the exit code.
    reaper: Reaper | None = None
    returncode: int | None = None
    killed_by_launcher: bool = False
    cleaned: bool = False  # it said it stopped everything it had started (wire.CLEANED)
    _open_fds: list[int] = field(default_factory=list)

    def poll(self) -> int | None:
        """Reap the process if it has exited; returns its return code (-signal if killed)."""
        if self.returncode is not None:
            return self.returncode
        if self.reaper is not None:
            self.returncode = self.reaper.poll()
            return self.returncode
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def ended_because(self) -> str | None:
        """Why it ended, where its reaper knows more than the exit code (a rank of the launch
        server that died with its server); None otherwise."""
        return self.reaper.ended_because() if isinstance(self.reaper, ExplainsEnd) else None

    def wait(self) -> int:
        if self.returncode is None:
            if self.reaper is not None:
                self.returncode = self.reaper.wait()
            else:
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def signal_group(self, signum: int) -> None:
        """Signal the process and every process of its group. Safe after reaping: a process
        group's id is not reused while any member lives, and a reaped pid is never signalled."""
        sends = [lambda: os.killpg(self.pid, signum)]
        if self.returncode is None:
            sends.append(lambda: os.kill(self.pid, signum))  # not yet reaped: the pid is still its own
        for send in sends:
            try:
                send()
                return
            except (ProcessLookupError, PermissionError):
                continue

    def kill(self) -> None:
        """SIGKILL the process, its group and every process below it, whatever their session."""
        if self.returncode is None:
            self.killed_by_launcher = True
            proctree.kill_tree(self.pid)
        else:
            self.signal_group(signal.SIGKILL)

    def rank_pipe_ends(self) -> list[tuple[str, str]]:
        """("pipe:[inode]" or "socket:[inode]", "w" or "r") of the ranks' ends of their pipes and
        control sockets: what a process the ranks started may hold, and nothing of the
        launcher's side does (see nblaunch.proctree)."""
        ends = []
        for r in self.ranks:
            ends += [(f"pipe:[{os.fstat(fd).st_ino}]", "w") for fd in (r.stdout_fd, r.stderr_fd, r.event_fd)]
            ends.append((r.control_link, "r"))  # a socketpair's ends are two inodes: the rank's is kept
        return ends

    def close(self) -> None:
        fdtable.close(self._open_fds)
        self._open_fds.clear()


@dataclass
class Pipes:
    stdout: tuple[int, int]
    stderr: tuple[int, int]
    events: tuple[int, int]
    control: tuple[int, int]  # (the rank's end, the launcher's end) of a socketpair

    @classmethod
    def open(cls) -> "Pipes":
        pipes = cls(fdtable.new_pipe(), fdtable.new_pipe(), fdtable.new_pipe(), fdtable.new_socketpair())
        for read_end, _ in (pipes.stdout, pipes.stderr, pipes.events):
            try:
                fcntl.fcntl(read_end, _F_SETPIPE_SZ, _PIPE_SIZE)
            except OSError:
                pass  # above the system's limit: the default size works, only slower
        return pipes

    @property
    def launcher_ends(self) -> list[int]:
        return [self.stdout[0], self.stderr[0], self.events[0], self.control[1]]

    @property
    def worker_ends(self) -> list[int]:
        return [self.stdout[1], self.stderr[1], self.events[1], self.control[0]]

    def close(self) -> None:
        """Close both ends (pipes no process was forked for)."""
        fdtable.close(self.launcher_ends + self.worker_ends)


def handle_for(pid: int, ranks: dict[int, Pipes], reaper: Reaper | None) -> WorkerProcess:
    links = {rank: f"socket:[{os.fstat(p.control[0]).st_ino}]" for rank, p in ranks.items()}
    fdtable.close([fd for pipes in ranks.values() for fd in pipes.worker_ends])  # the worker has them
    for pipes in ranks.values():
        for fd in (pipes.stdout[0], pipes.stderr[0], pipes.events[0]):
            os.set_blocking(fd, False)
    try:
        exit_fd = os.pidfd_open(pid)
        fdtable.hold([exit_fd])
    except (AttributeError, OSError):
        exit_fd = None
    launcher_fds = [fd for pipes in ranks.values() for fd in pipes.launcher_ends]
    launcher_fds += [exit_fd] if exit_fd is not None else []
    return WorkerProcess(
        pid=pid,
        ranks=[
            RankPipes(rank, p.stdout[0], p.stderr[0], p.events[0], p.control[1], links[rank])
            for rank, p in sorted(ranks.items())
        ],
        exit_fd=exit_fd,
        reaper=reaper,
        _open_fds=launcher_fds,
    )


def fork_process(ranks: dict[int, Pipes], child: Callable[[], NoReturn]) -> WorkerProcess:
    """Fork a process that hosts ``ranks``; in it, ``child()`` runs and never returns."""
    [worker] = fork_processes([(ranks, child)])
    return worker


def fork_processes(hosts: list[tuple[dict[int, Pipes], Callable[[], NoReturn]]]) -> list[WorkerProcess]:
    """Fork one process per ``(ranks, child)`` of ``hosts``, in order; in each, ``child()`` runs
    and never returns. All forks are made in one trip to the forking thread: a trip costs the
    launch 2 ms on busy cores (the thread and the caller wake each other), once instead of once
    per rank. If a fork fails, the processes already made are stopped and the error raised.

    Each child keeps only its own pipe ends (``fdtable``). SIGINT stays blocked in it until it
    has a process group of its own: an interrupt sent to the kernel's group in between would
    otherwise raise in the child, inside the launcher's code.
    """

    def fork_one(ranks: dict[int, Pipes], child: Callable[[], NoReturn]) -> int:
        with fdtable.forking([fd for pipes in ranks.values() for fd in pipes.worker_ends]):
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                pid = os.fork()
            except BaseException:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                raise
            if pid == 0:  # SIGINT stays blocked here until the child leads a group of its own
                try:
                    child()
                finally:
                    os._exit(70)  # never back into the launcher's code, whatever happened
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        try:
            os.setpgid(pid, pid)  # also done by the child; whoever is first wins the race
        except OSError:
            pass
        return pid

    def fork_all() -> tuple[list[int], BaseException | None]:  # on the forking thread
        pids: list[int] = []
        try:
            for ranks, child in hosts:
                pids.append(fork_one(ranks, child))
        except BaseException as error:  # the caller stops what was made, then raises
            return pids, error
        return pids, None

    def handles(made: tuple[list[int], BaseException | None]) -> list[WorkerProcess]:
        pids, error = made
        workers = [handle_for(pid, ranks, reaper=None) for pid, (ranks, _) in zip(pids, hosts)]
        if error is not None:
            for ranks, _ in hosts[len(pids):]:
                for pipes in ranks.values():
                    pipes.close()
        return workers

    def undo(made: tuple[list[int], BaseException | None]) -> None:  # interrupted meanwhile: nobody owns these
        kill_and_reap(handles(made))

    # A fork copies what the kernel's streams still buffer (ipykernel sends stdout and stderr on a
    # timer, and takes a forked child's flush as output of its own): each process would show the
    # kernel's last unsent line in the cell once more.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001  a stream that cannot flush has nothing to copy
            pass
    made = run_on_forking_thread(fork_all, undo)
    workers = handles(made)
    if made[1] is not None:
        kill_and_reap(workers)
        raise made[1]
    return workers


def kill_and_reap(workers: list[WorkerProcess]) -> None:
    """SIGKILL every process (and what it started), reap it, close the launcher's ends."""
    for worker in workers:
        worker.kill()
        worker.wait()
        worker.close()
