"""Whether the caller's thread is idle (between two notebook cells, or parked at the end of a
launch that blocks it): the only time this process imports ahead for its forked ranks
(``kernel_preload``).

An import on another thread while a cell imports the same library hands the cell a module half
initialised (importlib's deadlock avoidance: ``partially initialized module 'wandb' has no
attribute 'errors'``). Between cells nothing of the user's runs; when a cell begins, it first
waits for the package being imported to be done (``before_each_cell``).

A thread that waits for the warm-up itself parks meanwhile, and that counts as between cells:
a cell's ``nblaunch.warm_start(wait=...)``, and the end of every launch that blocks its caller
(``LocalHome.finish``: in a cell, a loop inside one, a script, ``nblaunch launch``), which
waits there until its ranks' imports are loaded for the next launch.

Example (what ``import nblaunch`` does in a kernel)::

    cells().watch(get_ipython())
    cells().wait_between()          # the preloading thread, before each package
    with cells().parked():          # the main thread, waiting for the warm-up
        ...
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator


class Cells:
    """This process's notebook cells, as IPython's events tell them."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = True  # nblaunch is imported inside a cell
        self._parked = 0  # the main thread waits for the warm-up (counts as between cells)
        self.watching = False
        self._before: list[Callable[[], None]] = []

    def watch(self, shell: object) -> None:
        """Follow ``shell``'s cells (IPython's ``pre_run_cell`` and ``post_run_cell``), once."""
        if self.watching:
            return
        events = getattr(shell, "events", None)
        try:
            events.register("pre_run_cell", self._cell_begins)
            events.register("post_run_cell", self._cell_ended)
        except Exception:  # noqa: BLE001  an IPython without these events: nothing is imported ahead here
            return
        self.watching = True

    def before_each_cell(self, callback: Callable[[], None]) -> None:
        """``callback()`` on the main thread as each cell begins, before its code runs."""
        self._before.append(callback)

    @property
    def between(self) -> bool:
        return (self.watching and not self._running) or self._parked > 0

    def wait_between(self, timeout: float | None = None) -> bool:
        """Wait until no cell runs (or the caller is parked); False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self.between, timeout)

    @contextlib.contextmanager
    def parked(self) -> Iterator[None]:
        """The caller's thread waits in the body for nothing but the warm-up (a cell's
        ``warm_start(wait=...)``, or the end of a launch that blocks it, in a cell or a script);
        when it goes on it first waits for the package under way (as a cell that begins does)."""
        with self._changed:
            self._parked += 1
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._parked -= 1
            self._run_before()

    def _cell_begins(self, *_: object) -> None:
        with self._changed:
            self._running = True
        self._run_before()

    def _run_before(self) -> None:
        """The main thread goes on (a cell begins, or the warm-up's wait ends): each callback."""
        for callback in self._before:
            try:
                callback()
            except Exception:  # noqa: BLE001  never the user's cell's (nor the caller's) failure
                pass

    def _cell_ended(self, *_: object) -> None:
        with self._changed:
            self._running = False
            self._changed.notify_all()


_cells = Cells()


def cells() -> Cells:
    """This process's."""
    return _cells


def _forget_in_child() -> None:
    global _cells
    _cells = Cells()  # a rank runs no cells


os.register_at_fork(after_in_child=_forget_in_child)
