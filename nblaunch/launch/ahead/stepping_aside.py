"""Warm-up work steps aside while a launch runs on cores it would otherwise share.

Importing ahead (this process's thread, its probe, the launch server's generations) is work for
the next launch; the launch under way comes first. Where its ranks take every core but one (2
ranks on a 2-core laptop), the warm-up would slow them down: then this process's imports wait
between two packages, and the processes importing ahead that registered here (a probe, a
generation not yet ready) are stopped (SIGSTOP) until the launch ends. Where cores are left (one
rank on a 16-core GPU machine), all of it goes on; so it does beside warm ranks, idle between
calls for as long as the pool lives. One register per process (``launches()``), for every launch
(fork or server) and every warm-up.

Example::

    launches().began(plan)                         # from a launch's start (2 ranks, 2 cores) ...
    with launches().pausing(Paused(probe_pid)):    # (a process importing ahead: stopped meanwhile)
        ...
    launches().wait_turn()                         # (a thread importing ahead, between packages)
    launches().ended()                             # ... to its end
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator, Protocol

from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.per_process import per_process
from nblaunch.worker.calls import serve_calls


FREE_CORES_WANTED = 2  # a launch leaving fewer than this many cores free runs alone


class Pausable(Protocol):
    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Paused:
    """A process of ours that imports ahead, stopped by SIGSTOP and let go by SIGCONT."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass


def cores_left(num_processes: int) -> int:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return usable - num_processes


class Launches:
    """This process's launches under way, and the warm-up work that steps aside for them."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._alone = 0  # launches that want the machine to themselves
        self._under_way = 0  # every launch
        self._pausable: list[Pausable] = []

    def began(self, plan: LaunchPlan) -> bool:
        """A launch of ``plan`` starts (``ended`` must follow); True if it runs alone."""
        alone = plan.request.function is not serve_calls and cores_left(plan.num_processes) < FREE_CORES_WANTED
        with self._changed:
            self._under_way += 1
            if alone:
                self._alone += 1
                if self._alone == 1:
                    for pausable in self._pausable:
                        pausable.pause()
        return alone

    def ended(self, alone: bool) -> None:
        with self._changed:
            self._under_way = max(0, self._under_way - 1)
            if alone:
                self._alone = max(0, self._alone - 1)
                if self._alone == 0:
                    for pausable in self._pausable:
                        pausable.resume()
            self._changed.notify_all()

    @property
    def alone(self) -> bool:
        return self._alone > 0

    @property
    def under_way(self) -> bool:
        """Whether any launch of this process runs (ranks on standby are not made meanwhile)."""
        return self._under_way > 0

    def wait_turn(self, timeout: float | None = None) -> bool:
        """Wait while a launch runs alone; False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._alone == 0, timeout)

    @contextlib.contextmanager
    def pausing(self, pausable: Pausable) -> Iterator[None]:
        """While the body runs, ``pausable`` is stopped whenever a launch runs alone."""
        with self._changed:
            self._pausable.append(pausable)
            if self._alone:
                pausable.pause()
        try:
            yield
        finally:
            with self._changed:
                self._pausable.remove(pausable)
                if self._alone:
                    pausable.resume()  # no longer ours to hold


launches = per_process(Launches)
