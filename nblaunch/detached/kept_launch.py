"""Where a detached launch is kept, as :class:`~nblaunch.detached.detached_launch.DetachedLaunch` sees it:
the one seam between the handle (watch, result, cancel, the same for every place) and a place.

:class:`KeptLaunch` is the interface; :class:`KeptInAFolder` is a launch whose supervisor runs on
this machine (``nblaunch.detached.daemon``, the folder of ``store``); a launch kept by a
detached actor of a Ray cluster is ``nblaunch.cluster.ray_keeper.KeptOnRay``.

Example::

    place = KeptInAFolder(folder)
    place.state()["function"], place.alive(), place.outcome()
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any, Protocol

import cloudpickle

from nblaunch.detached import store
from nblaunch.detached.journal import JournalReader
from nblaunch.events import Event

__all__ = ["KeptLaunch", "EventReader", "KeptInAFolder"]


class EventReader(Protocol):
    def read_available(self) -> list[Event]:
        """The events written since the last call, from the launch's first."""


class KeptLaunch(Protocol):
    launch_id: str
    where: str  # in words, for messages: "this machine", "the Ray cluster at ..."

    def state(self) -> dict[str, Any]:
        """id, function, num_processes, started, status (and log_dir once known)."""

    def alive(self) -> bool:
        """Whether what keeps the launch (its supervisor) still runs."""

    def reader(self) -> EventReader:
        """A reader of the launch's events from the first (each watcher has its own)."""

    def outcome(self) -> tuple[str, Any] | None:
        """``("ok", results)`` or ``("error", exception)`` once the launch has ended."""

    def mark_collected(self) -> None:
        """A kernel has had the outcome: it may be forgotten sooner."""

    def signal(self, what: str) -> bool:
        """"cancel" or "stacks"; False where nothing runs any more."""

    def logs(self, rank: int) -> str:
        """Rank ``rank``'s whole log so far."""

    def lost_message(self) -> str:
        """What to say, and where to look, when the keeper died before the launch ended."""


class KeptInAFolder:
    """A launch kept by a supervisor on this machine, in one of ``store``'s folders."""

    where = "this machine"

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.launch_id = os.path.basename(folder)

    def state(self) -> dict[str, Any]:
        return store.read_state(self.folder)

    def alive(self) -> bool:
        return store.supervisor_alive(self.state())

    def reader(self) -> EventReader:
        return JournalReader(os.path.join(self.folder, "journal"))

    def outcome(self) -> tuple[str, Any] | None:
        state = self.state()
        if "ended" not in state and store.supervisor_alive(state):
            return None  # store.finish writes the outcome, then the state: status is final once this returns
        try:
            with open(os.path.join(self.folder, "outcome.pkl"), "rb") as file:
                data = file.read()
        except FileNotFoundError:
            return None
        try:
            return cloudpickle.loads(data)
        except Exception as error:  # a class of the launch's, not importable here
            with open(os.path.join(self.folder, "where.json"), encoding="utf-8") as file:
                where = json.load(file)
            return ("error", RuntimeError(
                f"the launch ended, but its outcome cannot be read in this process ({type(error).__name__}: {error}): "
                f"it needs what the launching kernel could import (its folder {where['cwd']} and sys.path); "
                "import that module here, then call result() again"))

    def mark_collected(self) -> None:
        open(os.path.join(self.folder, "collected"), "a").close()

    def signal(self, what: str) -> bool:
        state = self.state()
        if "supervisor_pid" not in state or not store.supervisor_alive(state) or "ended" in state:
            return False
        os.kill(state["supervisor_pid"], {"cancel": signal.SIGTERM, "stacks": signal.SIGUSR1}[what])
        return True

    def logs(self, rank: int) -> str:
        log_dir = self.state().get("log_dir", "")
        with open(os.path.join(log_dir, f"rank{rank}.log"), encoding="utf-8", errors="replace") as log:
            return log.read()

    def lost_message(self) -> str:
        supervisor_log = os.path.join(self.folder, "supervisor.log")
        logs = self.state().get("log_dir") or supervisor_log
        return (f"the supervisor of detached launch {self.launch_id} ({self.state()['function']}) died before "
                f"the launch ended; its ranks were stopped with it. What they printed is in {logs}; "
                f"the supervisor's own output in {supervisor_log}")
