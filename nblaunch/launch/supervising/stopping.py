"""How the supervisor stops a launch's ranks: stacks first (briefly), then SIGKILL to every rank's
process group (a rank blocked in a C++ collective cannot run a Python handler; SIGKILL needs
none), then every rank reaped and every pipe closed. The supervisor's own part, kept apart from
its watching: :class:`~nblaunch.launch.supervising.supervisor.Supervisor` is a ``StoppingRanks``.

Example (what the supervisor does on a failure, then on its way out)::

    self._stop(0.05, fallback=False)
    self._teardown()
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

from nblaunch.events import Event, Stacks
from nblaunch.proctree import stat_fields

_FAULTHANDLER_GRACE_S = 0.3  # for ranks whose Python threads could not answer (GIL held in C)
_FULL_REPORT_S = 1.0  # a failed rank sends its traceback and exits within milliseconds of its first report
_FULL_REPORT_BUSY_S = 5.0  # ...or, on a machine busy with other work, while it keeps using a CPU on it
_REAP_BACKSTOP_S = 10.0
_SILENT = ("(it did not answer within {budget:g} s: busy in C holding Python's lock, or starved of CPU; "
           "faulthandler's dump of its threads, where it could write one, is in its stderr above)")


class StoppingRanks:
    """The stopping half of the supervisor (it provides ``_live``, ``_pump``, the ranks and pipes)."""

    _live: Callable[[], list[Any]]
    _live_processes: Callable[[], list[Any]]
    _pump: Callable[[float | None], None]
    _emit: Callable[[Event], None]

    def _stop(self, stack_budget: float, *, fallback: bool) -> None:
        """Collect the live ranks' stacks within ``stack_budget`` seconds, then kill them all."""
        self._stopping = True
        self._stacks_why = "stop"
        self._stacks.clear()  # a snapshot taken earlier is not where the ranks were stopped
        asked = [r for r in self._live() if r.failure is None]
        for rank in asked:
            rank.pipes.request_stacks()
        self._pump_until(lambda: all(r.finished or r.number in self._stacks for r in asked), stack_budget)
        silent = [r for r in asked if not r.finished and r.number not in self._stacks]
        if fallback and silent:
            for pid in {rank.process.pid for rank in silent}:  # faulthandler dumps from C, into stderr
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            self._pump_until(lambda: False, _FAULTHANDLER_GRACE_S)
            for rank in silent:  # said, not left out: the cell and the error list every rank asked
                if rank.number not in self._stacks:
                    self._keep_stacks(rank.number, _SILENT.format(budget=stack_budget))
        # A failed rank gets a moment to send its traceback and leave by itself (stopping what it
        # started, flushing C's buffers: often the best clue); the others stop now.
        waiting = [r for r in self._live() if r.failure is not None]
        for process in self._live_processes():
            if not any(r.process is process for r in waiting):
                process.kill()
        self._pump_until(lambda: all(r.finished for r in waiting), _FULL_REPORT_S)
        # Starved of CPU (other work on the machine), a rank still writing its report is working,
        # not hung: wait on while its CPU time grows, up to _FULL_REPORT_BUSY_S in all.
        used = {r.process.pid: _cpu_ticks(r.process.pid) for r in waiting if not r.finished}
        end = time.monotonic() + _FULL_REPORT_BUSY_S - _FULL_REPORT_S
        while used and time.monotonic() < end:
            self._pump_until(lambda: all(r.finished for r in waiting), 0.25)
            now = {pid: _cpu_ticks(pid) for pid in {r.process.pid for r in waiting if not r.finished}}
            used = {pid: ticks for pid, ticks in now.items() if ticks is not None and ticks > (used.get(pid) or 0)}
        for process in self._live_processes():
            process.kill()

    def _keep_stacks(self, rank: int, text: str) -> None:
        """Where ``rank`` is (its answer, or why there is none): kept for the error, shown in the cell."""
        self._stacks[rank] = text
        self._emit(Stacks(rank=rank, text=text, why=self._stacks_why))

    def _pump_until(self, done: Callable[[], bool], budget: float) -> None:
        end = time.monotonic() + budget
        while not done() and self._live():
            left = end - time.monotonic()
            if left <= 0:
                return
            self._pump(left)

    def _teardown(self) -> None:
        """Kill and reap every rank, close every pipe, once, on every path out of ``run``."""
        if self._wake_read == -1:  # done already (an interrupt's stop tears down before raising)
            return
        for process in self._live_processes():
            process.kill()
        end = time.monotonic() + _REAP_BACKSTOP_S
        while self._live() and time.monotonic() < end:
            self._pump(0.1)
        for process in self._processes:
            if process.returncode is None:  # stuck in the kernel (D state) past the backstop: reap blocking
                process.wait()
            for pipes in process.ranks:
                self._ranks[pipes.rank].finished = True
            process.close()
        self._selector.close()
        with self._wake_lock:
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_read = self._wake_write = -1


def _cpu_ticks(pid: int) -> int | None:
    """The CPU time ``pid`` has used (user + system, clock ticks); None if it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[11]) + int(fields[12])
