"""The kernel's side of a detached launch: start one, list them, attach to one, and the handle
(:class:`DetachedLaunch`) that watches it, waits for its outcome and cancels it.

Example::

    launch = notebook_launcher(train, num_processes=2, detach=True)   # returns at once
    # ... the kernel is restarted ...
    from nblaunch import attach, launches
    launches()            # this user's launches on this machine
    launch = attach()     # the latest: its dashboard replayed, then live
    launch.result()       # every rank's result, also if it ended while no kernel watched
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
import signal
import threading
import time
from typing import Any

import cloudpickle

from nblaunch.detached import store
from nblaunch.detached.jobs import LaunchJob, start_supervisor
from nblaunch.detached.journal import JournalReader
from nblaunch.display import make_display
from nblaunch.events import LaunchFinished, RankState
from nblaunch.launch.planning.plan import LaunchPlan, LaunchRequest

__all__ = ["DetachedLaunch", "LaunchInfo", "LaunchLostError", "start_detached", "launches", "attach"]

_FOLLOW_EVERY_S = 0.05  # how often a watcher looks for new events: the dashboard's own pace
_FINAL = ("done", "failed", "timed out", "cancelled", "interrupted")


class LaunchLostError(RuntimeError):
    """The supervisor of a detached launch died before the launch ended (its ranks died with it)."""


def start_detached(request: LaunchRequest, plan: LaunchPlan, display: Any) -> "DetachedLaunch":
    """Start ``request`` (already checked: ``plan`` is its plan here) under a supervisor of its
    own, outside this process's tree, and return its handle, watching in ``display``."""
    job = LaunchJob(dataclasses.replace(request, display="none"))
    folder = start_supervisor(job, kind="launch", function=request.function_name, num_processes=plan.num_processes)
    launch = DetachedLaunch(folder)
    launch.watch(display)
    return launch


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """One detached launch, as :func:`launches` lists it."""

    id: str
    function: str
    status: str
    started: str
    ranks: int
    log_dir: str

    def __repr__(self) -> str:
        return f"{self.id}  {self.status:<11} {self.started}  {self.function} on {self.ranks} ranks  logs: {self.log_dir}"


class _Listing(list):
    def __repr__(self) -> str:
        return "\n".join(map(repr, self)) if self else "no detached launches"


def launches() -> list[LaunchInfo]:
    """This user's detached launches on this machine, oldest first. Finished ones are kept a day
    after ``result()`` collected them, a week otherwise."""
    store.prune()
    listing = _Listing()
    for folder in store.launch_folders(kind="launch"):
        launch = DetachedLaunch(folder)
        state = launch.state()
        listing.append(LaunchInfo(state["id"], state["function"], launch.status,
                                  time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state["started"])),
                                  state["num_processes"], state.get("log_dir", "")))
    return listing


def attach(launch_id: str | None = None, display: Any = "auto") -> "DetachedLaunch":
    """The detached launch ``launch_id`` (or the latest; a unique prefix will do), its dashboard
    replayed in this cell and then live. Watching never changes the launch: stop watching with
    ``detach()``, stop the launch with ``cancel()``."""
    folders = store.launch_folders(kind="launch")
    if launch_id is not None:
        folders = [folder for folder in folders if os.path.basename(folder).startswith(launch_id)]
        if len(folders) != 1:
            known = ", ".join(os.path.basename(f) for f in store.launch_folders(kind="launch")) or "none"
            what = "no" if not folders else "more than one"
            raise LookupError(f"{what} detached launch of this user has an id starting with {launch_id!r} "
                              f"(launches(): {known})")
    elif not folders:
        raise LookupError("no detached launch to attach to: notebook_launcher(..., detach=True) starts one")
    launch = DetachedLaunch(folders[-1])
    launch.watch(display)
    return launch


class DetachedLaunch:
    """A launch running under a supervisor of its own (or ended), seen from any kernel of its user.

    Example::

        launch = attach()
        launch.status       # "running"
        launch.cancel()     # stops every rank, from any kernel
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.launch_id = os.path.basename(folder)
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()

    def state(self) -> dict[str, Any]:
        return store.read_state(self.folder)

    @property
    def status(self) -> str:
        """starting, running, done, failed, timed out, cancelled, interrupted, or lost (its
        supervisor died before the end)."""
        state = self.state()
        if state.get("status") in _FINAL or os.path.exists(self._outcome_path):
            return state.get("status", "done")
        return state.get("status", "starting") if store.supervisor_alive(state) else "lost"

    @property
    def log_dir(self) -> str:
        return self.state().get("log_dir", "")

    @property
    def _outcome_path(self) -> str:
        return os.path.join(self.folder, "outcome.pkl")

    def done(self) -> bool:
        return self.status in _FINAL or self.status == "lost"

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the end (at most ``timeout`` seconds) and return every rank's result, or
        raise what the launch raised; :class:`LaunchLostError` if its supervisor died first."""
        __tracebackhide__ = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while not os.path.exists(self._outcome_path):
            if self.status == "lost":
                raise LaunchLostError(self._lost_message())
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the detached launch {self.launch_id} is still {self.status}")
            time.sleep(_FOLLOW_EVERY_S)
        with open(self._outcome_path, "rb") as file:
            kind, value = cloudpickle.loads(file.read())
        open(os.path.join(self.folder, "collected"), "a").close()
        if self._watcher is not None:  # the dashboard shows the end before the call returns
            self._watcher.join(timeout=10)
        if kind == "error":
            raise value.with_traceback(None)
        return value

    def _lost_message(self) -> str:
        logs = self.log_dir or os.path.join(self.folder, "supervisor.log")
        return (f"the supervisor of detached launch {self.launch_id} ({self.state()['function']}) died before "
                f"the launch ended; its ranks were stopped with it. What they printed is in {logs}; "
                f"the supervisor's own output in {os.path.join(self.folder, 'supervisor.log')}")

    def cancel(self) -> bool:
        """Stop every rank (their stacks go to the logs); ``result()`` then raises
        LaunchCancelledError. False if the launch had already ended."""
        return self._signal(signal.SIGTERM)

    def request_stacks(self) -> bool:
        """Ask every rank for its stack: the answers appear in the dashboard and the logs."""
        return self._signal(signal.SIGUSR1)

    def _signal(self, which: int) -> bool:
        state = self.state()
        if self.done() or "supervisor_pid" not in state or not store.supervisor_alive(state):
            return False
        os.kill(state["supervisor_pid"], which)
        return True

    def logs(self, rank: int) -> str:
        """Rank ``rank``'s whole log so far."""
        with open(os.path.join(self.log_dir, f"rank{rank}.log"), encoding="utf-8", errors="replace") as log:
            return log.read()

    def watch(self, display: Any = "auto") -> None:
        """Show the launch in ``display`` (made here: a widget shows in this cell): everything
        so far, then live, until it ends or :meth:`detach`."""
        self.detach()
        if display == "none":
            return  # nothing to show: no reason to read the journal
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
        reader = JournalReader(os.path.join(self.folder, "journal"))
        try:
            while not stop.is_set():
                for event in reader.read_available():
                    display.on_event(event)
                    if isinstance(event, LaunchFinished):
                        return
                if self.status == "lost":
                    display.on_event(LaunchFinished(RankState.STOPPED, 0.0, summary=self._lost_message()))
                    return
                stop.wait(_FOLLOW_EVERY_S)
        finally:
            display.close()

    def __repr__(self) -> str:
        state = self.state()
        return (f"<DetachedLaunch {self.launch_id}: {state['function']} on {state['num_processes']} ranks, "
                f"{self.status} when shown; attach('{self.launch_id}') from any kernel>")

