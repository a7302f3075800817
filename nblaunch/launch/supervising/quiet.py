"""Noticing a launch that has gone quiet, so a hang shows where it is before any timeout.

A rank stuck in a collective, a deadlock or an endless loop prints nothing. When no rank has
printed, reported progress or logged a metric for ``after`` seconds, the supervisor asks every
live rank for its stack (it answers from a side thread; nothing is stopped), and the cell shows
where each one is. A launch that stays quiet is asked again after twice as long, then four
times, so a long silent step costs a handful of snapshots, not a stream of them.

Example::

    watch = QuietWatch(after=30.0, now=time.monotonic())
    watch.heard(time.monotonic())        # on any output, progress or metric
    if watch.due(time.monotonic()):      # True once per silent stretch (and its back-offs)
        ask_every_rank_for_its_stack()
"""

from __future__ import annotations

QUIET_STACKS_S = 30.0  # long enough for a slow step, short enough that a hang is seen early


class QuietWatch:
    """Says when the whole launch has been silent for ``after`` s, ``2 * after`` s, ..."""

    def __init__(self, after: float | None, now: float) -> None:
        self._after = after
        self._last_heard = now
        self._next_due = None if after is None else now + after

    def heard(self, now: float) -> None:
        self._last_heard = now
        if self._after is not None:
            self._next_due = now + self._after

    def wait(self, now: float) -> float | None:
        """Seconds until the next snapshot falls due (None: never)."""
        return None if self._next_due is None else max(0.0, self._next_due - now)

    def due(self, now: float) -> bool:
        if self._next_due is None or now < self._next_due:
            return False
        silent_for = now - self._last_heard
        self._next_due = self._last_heard + 2 * silent_for  # back off: 30 s, 60 s, 120 s, ...
        return True

    def silent_for(self, now: float) -> float:
        return now - self._last_heard
