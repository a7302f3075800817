"""One call on warm ranks, seen from the calling cell: its events, its display, its results.

The pool's launch runs in a thread of its own for as long as the ranks live, and its events go
to a :class:`CallRouter`. While a call runs, the router queues the call's events; the calling
thread (the cell's) takes them off the queue and feeds the call's own display, so everything a
call shows lands in the cell that made it, and text displays print with that cell's context.
Between calls nothing is shown (the rank logs keep every line).

Example (what ``WarmRanks.run`` does)::

    call = router.begin(call_id=7, num_ranks=2)
    ...  # send the call to the ranks
    for event in call.events(deadline):
        display.on_event(event)
    router.end(call)
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from nblaunch.events import (CallFailed, CallFinished, CallSteps, Event, GroupReleased, LaunchFinished, LaunchStarted,
                             RankStarted)


# A call's dashboard is made once the call has run this long: most cells take milliseconds, and
# making its widgets cost a %%distributed cell more than the call itself (15 of its 37 ms).
CALL_DASHBOARD_AFTER_S = 0.25


class CallTimedOut(Exception):
    """The call's deadline passed with ranks still working."""


class Call:
    """The events of one call, in order, up to its last rank's answer or the pool's end."""

    def __init__(self, call_id: int, num_ranks: int) -> None:
        self.call_id = call_id
        self.num_ranks = num_ranks
        self.results: dict[int, Any] = {}
        self.failures: dict[int, Any] = {}  # rank -> RankFailure: the call raised there
        self.steps: dict[int, int] = {}  # rank -> step boundaries passed, when an interrupt asked
        self.released: dict[int, str] = {}  # rank -> "" (released its group) or why it could not
        self.ended: LaunchFinished | None = None  # the pool ended during the call
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, event: Event) -> None:
        self._queue.put(event)

    @property
    def over(self) -> bool:
        return self.ended is not None or len(self.results) + len(self.failures) >= self.num_ranks

    @property
    def unanswered(self) -> list[int]:
        return [r for r in range(self.num_ranks) if r not in self.results and r not in self.failures]

    def events(self, deadline: float | None, tick: float | None = None) -> Iterator[Event | None]:
        """Every event to show until each rank answered (or the pool ended), and None every
        ``tick`` seconds without one; raises CallTimedOut at ``deadline`` (the caller then stops
        the pool and keeps reading)."""
        while not self.over:
            waits = [w for w in (None if deadline is None else deadline - time.monotonic(), tick) if w is not None]
            if deadline is not None and waits[0] <= 0:
                raise CallTimedOut()
            try:
                event = self._queue.get(timeout=min(waits) if waits else None)
            except queue.Empty:
                yield None
                continue
            if isinstance(event, (CallFinished, CallFailed, CallSteps)) and event.call_id != self.call_id:
                continue  # an earlier call's late answer
            if isinstance(event, CallFinished):
                self.results[event.rank] = event.result
                continue
            if isinstance(event, CallFailed):  # numbered as the event is (a node's ranks are renumbered)
                self.failures[event.rank] = dataclasses.replace(event.failure, rank=event.rank)
                continue
            if isinstance(event, CallSteps):
                self.steps[event.rank] = event.steps
                continue
            if isinstance(event, GroupReleased):
                self.released[event.rank] = event.why_not
                continue
            if isinstance(event, LaunchFinished):
                self.ended = event
            yield event


class CallRouter:
    """The pool launch's display: the plan and pids for every call, each call's events to it."""

    steps_per_call = True  # the pool launch's steps are each call's (``WarmRanks.steps``), not the launch's

    def __init__(self, num_ranks: int) -> None:
        self._lock = threading.Lock()
        self._call: Call | None = None
        self.started: LaunchStarted | None = None
        self.pids: dict[int, int] = {}
        self.ended: LaunchFinished | None = None
        self._num_ranks = num_ranks
        self.ranks_up = threading.Event()  # every rank started: calls can be sent
        self.up_since = time.strftime("%H:%M:%S")
        self.calls_before = 0  # calls these ranks finished before the current one

    def on_event(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, LaunchStarted):
                self.started = event
            elif isinstance(event, RankStarted):
                self.pids[event.rank] = event.pid
                if len(self.pids) == self._num_ranks:
                    self.ranks_up.set()
            elif isinstance(event, LaunchFinished):
                self.ended = event
                self.ranks_up.set()  # nobody waits for ranks that will never start
            call = self._call
        if call is not None and not isinstance(event, (LaunchStarted, RankStarted)):
            call.put(event)

    def close(self) -> None:
        pass

    def begin(self, call_id: int, num_ranks: int) -> Call:
        call = Call(call_id, num_ranks)
        with self._lock:
            self._call = call
            if self.ended is not None:  # the pool is already over: the call sees why at once
                call.put(self.ended)
        return call

    def end(self, call: Call) -> None:
        with self._lock:
            if self._call is call:
                self._call = None
                self.calls_before += 1
