"""Warm-up work steps aside while a launch runs on cores it would otherwise share.

Importing ahead (this process's thread, the launch server's generations) is work for the next
launch; the launch under way comes first. Where its ranks take every core but one (2 ranks on a
2-core laptop), the warm-up would slow them down: then the thread waits between two packages and
the generations still importing are stopped (SIGSTOP) until the launch ends. Where cores are
left (one rank on a 16-core GPU machine), both go on.

Example::

    launches = Launches()
    launches.began(num_processes=2)      # from the launch's start ...
    launches.wait_turn()                 # (the warm-up, between two packages: waits)
    launches.ended()                     # ... to its end
"""

from __future__ import annotations

import os
import threading

FREE_CORES_WANTED = 2  # a launch leaving fewer than this many cores free runs alone


def cores_left(num_processes: int) -> int:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    return usable - num_processes


class Launches:
    """The launches of this process under way that want the machine to themselves. Thread-safe."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._alone = 0

    def began(self, num_processes: int) -> bool:
        """A launch of ``num_processes`` ranks starts; True if the warm-up steps aside for it
        (then ``ended`` must follow)."""
        if cores_left(num_processes) >= FREE_CORES_WANTED:
            return False
        with self._changed:
            self._alone += 1
        return True

    def ended(self) -> None:
        with self._changed:
            self._alone = max(0, self._alone - 1)
            self._changed.notify_all()

    @property
    def alone(self) -> bool:
        return self._alone > 0

    def wait_turn(self, timeout: float | None = None) -> bool:
        """Wait while a launch runs alone; False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._alone == 0, timeout)
