"""After a call's failure or an interrupt: every rank back in its call loop, or the pool ended,
saying why.

A notebook keeps its variables when a cell raises or is interrupted; warm ranks should too. What
stands in the way is a collective: a rank left waiting for a peer that raised, or that stopped at
another step, waits for ever. :class:`Settling` is the calling cell's side of getting every rank
back, one rung at a time, each bounded:

- *a rank raised*: the others get ``RELEASE_AFTER_S`` to finish on their own; then every rank
  releases the pool's group (``nblaunch.worker.warm.group``: waiting collectives raise), and
  the group is re-formed after the call;
- *an interrupt*: the ranks are asked how many steps they took (``nblaunch.worker.step_stop``)
  and stop together at the next one; a call without steps, or ranks that do not get there
  within ``STOP_AT_STEP_WITHIN_S``, get SIGINT where they are; ranks that still do not come
  back are released as above. Interrupting again climbs one rung at once;
- interrupted ranks that come back from none of it within ``RETURN_WITHIN_S`` of their release
  end the pool (every rank stopped and reaped), and the reason is said. (Released after a
  failure alone, a rank that is still out works on by itself, as a cell would: it is waited for.)

Example (what ``WarmRanks`` does while a call runs)::

    settling = Settling(launch, call)
    for event in call.events(deadline, tick=settling.TICK_S):
        ...; ended_because = settling.tick()
    # KeyboardInterrupt: settling.interrupt()
"""

from __future__ import annotations

import pickle
import signal
import threading
import time
from typing import Any

from nblaunch import wire

RELEASE_AFTER_S = 1.0  # a peer raised: the other ranks may still be finishing their own work
STOP_AT_STEP_WITHIN_S = 10.0  # from the agreed step boundary to every rank back
RETURN_WITHIN_S = 5.0  # from SIGINT, or from a release, to every rank back
_ANSWER_STEPS_S = 1.0  # ranks answer from their watch thread, in milliseconds


class Settling:
    """One call's way back to a common point. ``tick()`` returns why the pool must end, or ""."""

    TICK_S = 0.1

    def __init__(self, launch: Any, call: Any) -> None:
        self._launch = launch
        self._call = call
        self.rung = ""  # "", "ask", "at", "now", "released"
        self._since = 0.0
        self.interrupted = False
        self.stop_step: int | None = None  # the boundary every rank stopped at, if they did
        self.released = False

    def interrupt(self) -> str:
        """The user's interrupt: start, or climb one rung at once. Returns why the pool must end, or ""."""
        first, self.interrupted = not self.interrupted, True
        if self.rung == "":
            self._climb("ask", wire.INTERRUPT, pickle.dumps(("ask",)))
            return ""
        if first and self.rung == "released":  # released after a failure: SIGINT the ranks still out
            self._launch.send(wire.INTERRUPT, pickle.dumps(("now",)))
            self._since = time.monotonic()
            return ""
        return self._next_rung()

    def tick(self) -> str:
        call, now = self._call, time.monotonic()
        if call.over:
            return ""
        if not self.interrupted and self.rung == "" and call.failures:
            first = min(f.failed_at or now for f in call.failures.values())
            if now - first >= RELEASE_AFTER_S:
                self._release()
            return ""
        if self.rung == "ask":
            unanswered = call.unanswered
            if all(r in call.steps for r in unanswered) or now - self._since >= _ANSWER_STEPS_S:
                steps = [call.steps.get(r, 0) for r in unanswered]
                if steps and all(steps):
                    self.stop_step = max(steps) + 1
                    self._climb("at", wire.INTERRUPT, pickle.dumps(("at", self.stop_step)))
                else:
                    self._climb("now", wire.INTERRUPT, pickle.dumps(("now",)))
            return ""
        # Released after a failure alone, a rank still out is working on its own (any collective
        # it reaches now raises): it is waited for, as a cell is; an interrupt climbs on from here.
        limit = {"at": STOP_AT_STEP_WITHIN_S, "now": RETURN_WITHIN_S,
                 "released": RETURN_WITHIN_S if self.interrupted else None}.get(self.rung)
        if limit is not None and now - self._since >= limit:
            return self._next_rung()
        return ""

    def _next_rung(self) -> str:
        if self.rung in ("ask", "at"):
            self.stop_step = None
            self._climb("now", wire.INTERRUPT, pickle.dumps(("now",)))
        elif self.rung in ("now", ""):
            self._release()
        else:
            left = ", ".join(map(str, self._call.unanswered))
            refused = "; ".join(why for why in self._call.released.values() if why)
            how = f"interrupted ({refused})" if refused else "released and interrupted"
            return (f"rank {left} did not come back within {RETURN_WITHIN_S:g} s of being {how}: it may ignore "
                    "SIGINT, or be stuck in C code or in a collective")
        return ""

    def _release(self) -> None:
        self.released = True
        self._climb("released", wire.RELEASE, b"")

    def _climb(self, rung: str, kind: bytes, body: bytes) -> None:
        self.rung, self._since = rung, time.monotonic()
        self._launch.send(kind, body)


class Presses:
    """Interrupts counted instead of raised while a call runs: the loop that shows the call reads
    the count (each press starts or climbs the ladder), so an interrupt never lands half-way
    through sending a frame, showing an event or ending the cell (the stop button pressed twice)."""

    def __init__(self) -> None:
        self._count = 0
        self._previous: Any = None

    def counting(self) -> None:
        if self._previous is None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._press)

    def take(self) -> int:
        count, self._count = self._count, 0
        return count

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _press(self, signum: int, frame: Any) -> None:
        self._count += 1
