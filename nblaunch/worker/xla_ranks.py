"""Ranks on XLA devices (TPU; the CPU in tests) started through torch_xla's ``xmp.spawn``.

The launcher forks one *host* process, which runs ``xmp.spawn(..., start_method="fork")``.
torch_xla then runs one process per chip and one thread per device inside it (TPU v2/v3: two
devices a chip; v4 and later: one). So several ranks can share a process: its file descriptors,
``os.environ`` and module globals. Each device thread therefore binds to its own rank's pipes
through a thread-local channel and a thread-routing ``sys.stdout``/``sys.stderr``; C-level output
of a process goes to the pipes of the first rank it hosts. Ranks come from
``torch_xla.runtime`` (``local_ordinal()``), never from the environment.

torch_xla pickles the function for its process pool even with fork, so the user's function
travels cloudpickled inside :class:`DeviceEntry`.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import NoReturn

import cloudpickle

from nblaunch.contract.failure import Phase
from nblaunch.worker import bootstrap, channel, lifeline, reports
from nblaunch.worker.control import ControlSocket
from nblaunch.worker.reports import RankGuard
from nblaunch.worker.streams import attach_streams, flush_streams, line_stream


@dataclass(frozen=True)
class RankEnds:
    """The worker ends of one rank's pipes (inherited through fork)."""

    stdout: int
    stderr: int
    events: int
    control: int


class _ThreadRoutedStream(io.TextIOBase):
    """A text stream that writes to the calling thread's rank, or to the process's default."""

    def __init__(self, default: io.TextIOBase):
        self._default = default
        self._mine = threading.local()
        self._all = [default]

    def bind(self, stream: io.TextIOBase) -> None:
        self._mine.stream = stream
        self._all.append(stream)

    def _target(self) -> io.TextIOBase:
        return getattr(self._mine, "stream", self._default)

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        for stream in self._all:
            stream.flush()

    def fileno(self) -> int:
        return self._target().fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


def run_host(
    environ: dict[str, str],
    parent_pid: int,
    packed_function: bytes,
    ranks: dict[int, RankEnds],
) -> NoReturn:
    """Entry point of the forked host process. Never returns into the launcher's code."""
    first = ranks[min(ranks)]
    try:
        # A failure before xmp.spawn is reported as the first rank's.
        with RankGuard(first.events, first.stderr) as guard:
            bootstrap.settle_forked_child(parent_pid)
            guard.phase = Phase.ATTACHING
            attach_streams(os.dup(first.stdout), os.dup(first.stderr))
            guard.stderr_fd = 2
            guard.phase = Phase.SETTING_UP
            os.environ.update(environ)
            lifeline.set_process_name("host")
            lifeline.become_subreaper()
            import torch_xla.distributed.xla_multiprocessing as xmp

        code = 0
        try:
            xmp.spawn(DeviceEntry(packed_function, ranks, os.getpid()), nprocs=None, start_method="fork")
        except BaseException:  # a rank's own failure was already reported by its DeviceEntry
            traceback.print_exc()
            code = 1
        bootstrap.leave_cleanly(first.events)
        os._exit(code)
    finally:
        os._exit(70)


class DeviceEntry:
    """What torch_xla calls in every device thread: ``DeviceEntry(...)(global_ordinal)``."""

    _setup_lock = threading.Lock()
    _router: _ThreadRoutedStream | None = None  # per process (set once, after fork)
    _router_err: _ThreadRoutedStream | None = None
    _router_pid: int | None = None

    def __init__(self, packed_function: bytes, ranks: dict[int, RankEnds], host_pid: int):
        self.packed_function = packed_function
        self.ranks = ranks
        self.host_pid = host_pid

    def __call__(self, global_ordinal: int) -> None:
        import torch_xla.runtime as xr

        rank = xr.local_ordinal()
        ends = self.ranks[rank]
        self._set_up_process(first_rank=rank)
        channel.open_channel(ends.events, this_thread_only=True)
        DeviceEntry._router.bind(line_stream(ends.stdout))
        DeviceEntry._router_err.bind(line_stream(ends.stderr))
        try:
            function, args = cloudpickle.loads(self.packed_function)
        except BaseException as error:
            reason = f"{Phase.LOADING.value}: {reports.describe(error)}"
            reports.send_failure(error, reason, phase=Phase.LOADING, hint=reports.hint_for(Phase.LOADING))
            return
        bootstrap.serve(function, args, ControlSocket(ends.control), ends.events)
        flush_streams()
        # Return normally even after a failure: the launcher already knows, and stops the rest.

    def _set_up_process(self, first_rank: int) -> None:
        with DeviceEntry._setup_lock:
            if DeviceEntry._router_pid == os.getpid():
                return  # another device thread of this process was first
            lifeline.die_with_parent(self.host_pid)
            lifeline.set_process_name(str(first_rank))
            ends = self.ranks[first_rank]
            # C-level output of the process goes to the first rank that starts in it.
            attach_streams(os.dup(ends.stdout), os.dup(ends.stderr))

            DeviceEntry._router = _ThreadRoutedStream(sys.stdout)
            DeviceEntry._router_err = _ThreadRoutedStream(sys.stderr)
            DeviceEntry._router_pid = os.getpid()
            sys.stdout = DeviceEntry._router
            sys.stderr = DeviceEntry._router_err
            bootstrap.prepare_process()
