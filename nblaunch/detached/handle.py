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
import sys
import threading
import time
from typing import Any


from nblaunch.detached import store
from nblaunch.detached.jobs import LaunchJob, start_supervisor
from nblaunch.detached.kept import KeptInAFolder, KeptLaunch
from nblaunch.display import make_display
from nblaunch.events import LaunchFinished, RankState
from nblaunch.launch.planning.plan import LaunchPlan, LaunchRequest

__all__ = ["DetachedLaunch", "LaunchInfo", "LaunchLostError", "start_detached", "launches", "attach", "find"]

_FOLLOW_EVERY_S = 0.05  # how often a watcher looks for new events: the dashboard's own pace
_FINAL = ("done", "failed", "timed out", "cancelled", "interrupted")


class LaunchLostError(RuntimeError):
    """The supervisor of a detached launch died before the launch ended (its ranks died with it)."""


def start_detached(request: LaunchRequest, plan: LaunchPlan, display: Any, cluster: str | None = None
                   ) -> "DetachedLaunch":
    """Start ``request`` (already checked: ``plan`` is its plan here) under a keeper of its own,
    a supervisor outside this process's tree (or, on Ray, a detached actor), and return its
    handle, watching in ``display``."""
    if cluster == "ray":
        from nblaunch.cluster.kept import start_on_ray  # deferred: Ray is optional

        launch = DetachedLaunch(start_on_ray(request, plan.world_size))
    else:
        job = LaunchJob(dataclasses.replace(request, display="none"))
        launch = DetachedLaunch(start_supervisor(job, kind="launch", function=request.function_name,
                                                 num_processes=plan.num_processes))
    launch.watch(display)
    return launch


def _all_kept(kinds: tuple[str, ...] = ("launch",)) -> list[KeptLaunch]:
    """This user's launches (of ``kinds``) kept here, then those kept on the Ray cluster this
    process is connected to (if it is: Ray is never loaded or joined for this)."""
    places: list[KeptLaunch] = [KeptInAFolder(folder) for kind in kinds for folder in store.launch_folders(kind=kind)]
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from nblaunch.cluster.kept import kept_on_ray  # deferred: Ray is optional

        places += kept_on_ray()
    return places


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """One detached launch, as :func:`launches` lists it."""

    id: str
    function: str
    status: str
    started: str
    ranks: int
    log_dir: str
    kind: str = "launch"  # or "pool": detached warm ranks (WarmRanks.attach() runs on them)

    def __repr__(self) -> str:
        what = f"warm ranks, {self.ranks} processes" if self.kind == "pool" else f"{self.function} on {self.ranks} ranks"
        return f"{self.id}  {self.status:<11} {self.started}  {what}  logs: {self.log_dir}"


class _Listing(list):
    def __repr__(self) -> str:
        return "\n".join(map(repr, self)) if self else "no detached launches"


def launches() -> list[LaunchInfo]:
    """This user's detached launches (and detached warm ranks), oldest first. Finished ones are
    kept a day after ``result()`` collected them, a week otherwise."""
    store.prune()
    listing = _Listing()
    for place in _all_kept(kinds=("launch", "pool")):
        launch = DetachedLaunch(place)
        state = launch.state()
        listing.append(LaunchInfo(state["id"], state["function"], launch.status,
                                  time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state["started"])),
                                  state["num_processes"], state.get("log_dir", ""), state.get("kind", "launch")))
    return listing


def attach(launch_id: str | None = None, display: Any = "auto") -> "DetachedLaunch":
    """The detached launch ``launch_id`` (or the latest; a unique prefix will do), its dashboard
    replayed in this cell and then live. Watching never changes the launch: stop watching with
    ``detach()``, stop the launch with ``cancel()``."""
    launch = find(launch_id)
    launch.watch(display)
    return launch


def find(launch_id: str | None, kinds: tuple[str, ...] = ("launch",)) -> "DetachedLaunch":
    """The detached launch (or, with "pool" in ``kinds``, warm ranks) ``launch_id`` (a unique
    start of its id; None: the latest), not watched."""
    every = _all_kept(kinds)
    places = every
    if launch_id is not None:
        places = [place for place in every if place.launch_id.startswith(launch_id)]
        if len(places) != 1:
            known = ", ".join(place.launch_id for place in every) or "none"
            what = "no" if not places else "more than one"
            raise LookupError(f"{what} detached launch of this user has an id starting with {launch_id!r} "
                              f"(launches(): {known})")
    elif not places:
        raise LookupError("no detached launch to attach to: notebook_launcher(..., detach=True) starts one")
    return DetachedLaunch(places[-1])


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
