"""Whether the caller's thread is parked in nblaunch: the only time this process imports ahead
for its forked ranks (``kernel_preload``).

An import on another thread while the user's code imports the same library hands it a module
half initialised (importlib's deadlock avoidance: ``partially initialized module 'wandb' has no
attribute 'errors'``). So this process imports ahead only while its caller waits in nblaunch for
nothing but those imports: at the end of every launch that blocks it (``RanksHome.ready_next``:
a cell, a loop inside one, a script), and in ``nblaunch.warm_start(wait=...)``. When the caller
goes on, it first waits for the package under way (``on_resume``).

Example::

    with caller().parked():          # the caller's thread, waiting for the imports
        ...
    caller().wait_parked()           # the importing thread, before each package
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

from nblaunch.per_process import per_process


class Caller:
    """This process's caller, as far as importing ahead goes."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._parked = 0
        self._on_resume: list[Callable[[], None]] = []

    @property
    def is_parked(self) -> bool:
        return self._parked > 0

    def wait_parked(self, timeout: float | None = None) -> bool:
        """Wait until the caller is parked; False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._parked > 0, timeout)

    def on_resume(self, callback: Callable[[], None]) -> None:
        """``callback()`` on the caller's thread each time it leaves ``parked``."""
        if callback not in self._on_resume:
            self._on_resume.append(callback)

    @contextlib.contextmanager
    def parked(self) -> Iterator[None]:
        """The caller's thread waits in the body for nothing but the imports ahead."""
        with self._changed:
            self._parked += 1
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._parked -= 1
            for callback in self._on_resume:
                try:
                    callback()
                except Exception:  # noqa: BLE001  never the caller's failure
                    pass


caller = per_process(Caller)  # a rank's own launches park their own caller
