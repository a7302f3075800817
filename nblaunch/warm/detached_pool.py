"""Warm ranks that outlive the kernel: ``WarmRanks(2, detach=True)`` and ``WarmRanks.attach()``.

A supervisor of their own (``nblaunch.detached``) keeps an ordinary :class:`WarmRanks` up, with
its process group and everything earlier calls stored in the ranks, and serves calls on a
private socket (:mod:`nblaunch.detached.call_socket`). :class:`DetachedWarmRanks` is the kernel's
side, with ``WarmRanks``' surface: each call goes to the supervisor, its events come back to a
display made in the calling cell, its results or error come back as the call's. Ctrl-C in the
kernel interrupts the call there as it would here (the ranks are stopped, and the next call
starts fresh ones).

Example::

    pool = WarmRanks(2, detach=True)
    pool.run(load_model)          # the model stays in the ranks
    # ... the kernel restarts ...
    pool = WarmRanks.attach()     # the same ranks, the model still there
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable

from nblaunch.detached import call_socket, store
from nblaunch.detached.jobs import start_supervisor
from nblaunch.display import make_display
from nblaunch.events import Display, LaunchFinished
from nblaunch.launch import ipython_errors
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.planning import pickling
from nblaunch.step_split import LaunchSteps, remember
from nblaunch.warm.call_router import CALL_DASHBOARD_AFTER_S

__all__ = ["DetachedWarmRanks", "Relay"]


class Relay:
    """The display of a call served for a kernel: every event goes to that kernel; if it went
    away, the call goes on unwatched."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.connected = True

    def on_event(self, event: Any) -> None:
        if self.connected:
            try:
                call_socket.send(self.connection, ("event", event))
            except call_socket.ChannelClosed:
                self.connected = False

    def close(self) -> None:
        pass


class DetachedWarmRanks:
    """Warm ranks kept by a supervisor of their own; ``WarmRanks(..., detach=True)`` makes one,
    ``WarmRanks.attach()`` finds it again from any kernel of the same user."""

    def __init__(self, folder: str, display: str | Display = "auto") -> None:
        self.folder = folder
        self.launch_id = os.path.basename(folder)
        self._display = display
        self._closed = False
        self._steps = LaunchSteps()

    @classmethod
    def start(cls, job: Any, num_processes: int, display: str | Display) -> "DetachedWarmRanks":
        """Start ``job`` (the pool's side, ``warm/pool_job.PoolJob``, its request checked already)
        under a supervisor of its own."""
        folder = start_supervisor(job, kind="pool", function="warm ranks", num_processes=num_processes)
        return cls(folder, display)

    @classmethod
    def latest(cls, launch_id: str | None = None, display: str | Display = "auto") -> "DetachedWarmRanks":
        pools = [cls(folder, display) for folder in store.launch_folders(kind="pool")]
        pools = [pool for pool in pools if pool.alive and pool.launch_id.startswith(launch_id or "")]
        if not pools:
            raise LookupError("no detached warm ranks of this user are up" +
                              (f" with an id starting with {launch_id!r}" if launch_id else "") +
                              ": WarmRanks(..., detach=True) starts them")
        return pools[-1]

    def _state(self) -> dict[str, Any]:
        return store.read_state(self.folder)

    @property
    def num_processes(self) -> int:
        return self._state()["num_processes"]

    @property
    def request(self) -> Any:
        """The pool's ``LaunchRequest``, as the kernel that started it made it."""
        return store.read_job(self.folder).request

    @property
    def steps(self) -> LaunchSteps:
        """The last call from this kernel: its training steps split, as ``WarmRanks.steps``."""
        return self._steps

    @property
    def alive(self) -> bool:
        """True while the supervisor keeping the ranks is up (the ranks start at the first call,
        and again after a failure, as for WarmRanks)."""
        state = self._state()
        return "ended" not in state and store.supervisor_alive(state)

    def run(self, function: Callable[..., Any], *args: Any, timeout: float | None = None,
            display: str | Display | None = None) -> list[Any]:
        """As ``WarmRanks.run``: ``[result of rank 0, rank 1, ...]``, the call shown in this cell."""
        __tracebackhide__ = True
        if self._closed or not self.alive:
            raise LaunchConfigError(f"the detached warm ranks {self.launch_id} are closed; make a new "
                                    "WarmRanks(..., detach=True) to run more")
        if not callable(function):
            raise LaunchConfigError(f"run() needs a function to call, got {type(function).__name__}")
        pickling.check_picklable(function, args)  # names the culprit, before anything is sent
        ipython_errors.install()
        connection = self._when_ready()
        shown = make_display(self._display if display is None else display, self.num_processes,
                             build_after_s=CALL_DASHBOARD_AFTER_S)
        try:
            call_socket.send(connection, ("run", function, args, timeout))
            kind, value = self._answer(connection, shown)
        except call_socket.ChannelClosed:
            raise RuntimeError(f"the supervisor of the detached warm ranks {self.launch_id} went away during the "
                               f"call: see {os.path.join(self.folder, 'supervisor.log')}") from None
        finally:
            shown.close()
            connection.close()
        if kind == "raised":
            raise value.with_traceback(None)
        return value

    def _when_ready(self) -> Any:
        """A connection whose turn has come; while another kernel's call runs, say so once. An
        interrupt while waiting gives up the turn (nothing was sent)."""
        connection = self._connect()
        connection.settimeout(1.0)
        try:
            while True:
                try:
                    call_socket.receive(connection)  # ("ready",)
                    break
                except TimeoutError:
                    print(f"nblaunch: waiting for another kernel's call on the detached warm ranks "
                          f"{self.launch_id} to end", file=sys.stderr)
                    connection.settimeout(None)
        except BaseException:
            connection.close()
            raise
        connection.settimeout(None)
        return connection

    def _connect(self) -> Any:
        deadline = time.monotonic() + 30  # a backstop: the supervisor listens within a second of starting
        while True:
            try:
                return call_socket.connect(self.launch_id)
            except call_socket.ChannelClosed:
                if time.monotonic() > deadline or not self.alive:
                    raise
                time.sleep(0.05)

    def _answer(self, connection: Any, shown: Display) -> tuple[str, Any]:
        """This call's events, then its answer. The first Ctrl-C interrupts the call there (this
        kernel's, whose turn it is); the report still comes back here."""
        interrupted = False
        while True:
            try:
                message = call_socket.receive(connection)
            except KeyboardInterrupt:
                if interrupted:
                    raise  # a second Ctrl-C: stop waiting (the supervisor goes on stopping the call)
                interrupted = True
                os.kill(self._state()["supervisor_pid"], signal.SIGINT)
                continue
            if message[0] == "event":
                if isinstance(message[1], LaunchFinished):  # the call's end carries its steps
                    self._steps = message[1].steps if message[1].steps is not None else LaunchSteps()
                    remember(self._steps)
                shown.on_event(message[1])
            else:
                return message

    def close(self) -> None:
        """Let the ranks leave and the supervisor end. Safe to call twice."""
        if self._closed or not self.alive:
            self._closed = True
            return
        self._closed = True
        connection = self._when_ready()
        with connection:
            call_socket.send(connection, ("close",))
            call_socket.receive(connection)

    def __enter__(self) -> "DetachedWarmRanks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "up" if self.alive and not self._closed else "closed"
        return (f"<WarmRanks (detached {self.launch_id}): {self.num_processes} processes, {state}; "
                f"WarmRanks.attach('{self.launch_id}') from any kernel>")
