"""The kernel's side of a detached launch: the handle (:class:`DetachedLaunch`) that watches
it, waits for its outcome and cancels it, wherever it is kept (a
:class:`~nblaunch.detached.kept_launch.KeptLaunch`: a supervisor here, an actor of a Ray
cluster). Homes start detached launches (``Cluster.keep``); ``nblaunch.api`` lists and finds them.

Example::

    launch = notebook_launcher(train, num_processes=2, detach=True)   # returns at once
    # ... the kernel is restarted ...
    launch = nblaunch.attach()   # the latest: its dashboard replayed, then live
    launch.result()              # every rank's result, also if it ended while no kernel watched
"""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from typing import Any

from nblaunch.detached.kept_launch import KeptInAFolder, KeptLaunch
from nblaunch.display import make_display
from nblaunch.events import LaunchFinished, LaunchRestarting, RankState, StepTimes
from nblaunch.step_split import LaunchSteps, StepBook

__all__ = ["DetachedLaunch", "LaunchLostError"]

_FOLLOW_EVERY_S = 0.05  # how often a watcher looks for new events: the dashboard's own pace
_FINAL = ("done", "failed", "timed out", "cancelled", "interrupted")


class LaunchLostError(RuntimeError):
    """The supervisor of a detached launch died before the launch ended (its ranks died with it)."""


class DetachedLaunch:
    """A launch running under a keeper of its own (a supervisor on this machine, or a detached
    actor of a Ray cluster), or ended, seen from any kernel of its user.

    Example::

        launch = attach()
        launch.status       # "running"
        launch.cancel()     # stops every rank, from any kernel
    """

    def __init__(self, place: "KeptLaunch | str") -> None:
        self._place: KeptLaunch = KeptInAFolder(place) if isinstance(place, str) else place
        self.launch_id = self._place.launch_id
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()

    def state(self) -> dict[str, Any]:
        return self._place.state()

    @property
    def status(self) -> str:
        """starting, running, done, failed, timed out, cancelled, interrupted, or lost (its
        keeper died before the end)."""
        state = self.state()
        if state.get("status") in _FINAL:
            return state["status"]
        return state.get("status", "starting") if self._place.alive() else "lost"

    @property
    def log_dir(self) -> str:
        return self.state().get("log_dir", "")

    def done(self) -> bool:
        return self.status in (*_FINAL, "lost")

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the end (at most ``timeout`` seconds) and return every rank's result, or
        raise what the launch raised; :class:`LaunchLostError` if its keeper died first."""
        __tracebackhide__ = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while (outcome := self._place.outcome()) is None:
            if self.status == "lost":
                raise LaunchLostError(self._place.lost_message())
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the detached launch {self.launch_id} is still {self.status}")
            time.sleep(_FOLLOW_EVERY_S)
        kind, value = outcome
        if self._watcher is not None:  # the dashboard shows the end before the call returns
            self._watcher.join(timeout=10)
        self._place.mark_collected()
        if kind == "error":
            raise value.with_traceback(None)
        return value

    @property
    def steps(self) -> LaunchSteps:
        """Every rank's training steps split into their parts, as ``Launch.steps``, read from the
        launch's folder: the whole launch's once it ended, else the steps its journal still keeps."""
        book = StepBook(self.state()["num_processes"])
        for event in self._place.reader().read_available():
            if isinstance(event, LaunchFinished) and event.steps is not None:
                return event.steps
            if isinstance(event, StepTimes):
                book.add(event.rank, event.steps)
            elif isinstance(event, LaunchRestarting):
                book.clear()  # the steps of the new start are counted afresh, as Launch.steps does
        return book.report()

    def cancel(self) -> bool:
        """Stop every rank (their stacks go to the logs); ``result()`` then raises
        LaunchCancelledError. False if the launch had already ended."""
        return not self.done() and self._place.signal("cancel")

    def request_stacks(self) -> bool:
        """Ask every rank for its stack: the answers appear in the dashboard and the logs."""
        return not self.done() and self._place.signal("stacks")

    def logs(self, rank: int) -> str:
        """Rank ``rank``'s whole log so far."""
        return self._place.logs(rank)

    def watch(self, display: Any = "auto") -> None:
        """Show the launch in ``display`` (made here: a widget shows in this cell): everything
        so far, then live, until it ends or :meth:`detach`."""
        self.detach()
        if display == "none":
            return  # nothing to show: no reason to read the events
        shown = make_display(display, self.state()["num_processes"])
        set_stop_handler = getattr(shown, "set_stop_handler", None)
        if set_stop_handler is not None:
            set_stop_handler(self.cancel, self.request_stacks)
        self._stop_watching = threading.Event()
        follow = functools.partial(self._follow, shown, self._stop_watching)
        if getattr(shown, "prints_to_cell", False):  # ipykernel keeps the watching cell in the context
            follow = functools.partial(contextvars.copy_context().run, follow)
        self._watcher = threading.Thread(target=follow, daemon=True, name=f"nblaunch-watch-{self.launch_id}")
        self._watcher.start()

    def detach(self) -> None:
        """Stop watching here; the launch goes on."""
        if self._watcher is not None:
            self._stop_watching.set()
            self._watcher.join()
            self._watcher = None

    def _follow(self, display: Any, stop: threading.Event) -> None:
        reader = self._place.reader()
        try:
            while not stop.is_set():
                events = reader.read_available()
                for event in events:
                    display.on_event(event)
                    if isinstance(event, LaunchFinished):
                        return
                status = self.status
                if status == "lost":
                    display.on_event(LaunchFinished(RankState.STOPPED, 0.0, summary=self._place.lost_message()))
                    return
                if not events and status in _FINAL and not reader.read_available():
                    return  # ended, and its last events are gone (collected elsewhere)
                stop.wait(_FOLLOW_EVERY_S)
        finally:
            display.close()

    def __repr__(self) -> str:
        state = self.state()
        return (f"<DetachedLaunch {self.launch_id}: {state['function']} on {state['num_processes']} ranks, "
                f"{self.status} when shown; attach('{self.launch_id}') from any kernel>")
