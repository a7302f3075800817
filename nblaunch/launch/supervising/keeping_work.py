"""Stopping a launch so that its work is kept: every rank goes on to one common step, saves its
state there and leaves (the launcher's side of ``nblaunch.worker.step_stop``).

An interrupt, a ``timeout=`` that runs out, or ``cancel()`` would otherwise kill the ranks where
they are, and what they trained since the user's last own checkpoint would be gone. Where the
ranks train through nblaunch's ``Accelerator`` (their ``backward`` counts step boundaries) and this
supervisor holds every rank of the launch, it first asks each rank how many boundaries it passed,
tells them all the same next one (``step_stop.agreed_boundary``), and waits, pumping their output,
while they finish that step and save (``SAVING`` says where, ``STOPPED`` that it is written).
Each wait is bounded; a second interrupt stops at once, saying what was not saved. Whatever does
not work out falls back to the plain stop (stacks, SIGKILL), as before.

Example (what the supervisor does on an interrupt)::

    kept = self._stop_keeping_work("interrupted")   # KeptWork, or None: stop the plain way
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Callable

from nblaunch import wire
from nblaunch.events import Event, LaunchStopping
from nblaunch.launch.errors import KeptWork
from nblaunch.launch.supervising.interrupts import counting_interrupts
from nblaunch.worker.step_stop import agreed_boundary

ANSWER_WITHIN_S = 1.0  # ranks answer from their watch thread, in milliseconds
# From the agreed boundary to every rank saving: the step, the rest of the loop's body and, after
# an epoch's last step, its end-of-epoch code. Fixed, so that a stalled launch's timeout= does not
# wait long for a step that never comes (a longer evaluation falls back to the plain stop).
REACH_THE_STEP_WITHIN_S = 60.0
SAVE_WITHIN_S = 600.0  # a big model's sharded save takes a while; a second interrupt cuts it short
STACKS_ON_STOP_S = 2.0  # interrupt/timeout: the user asked where things are, wait a bit more
_TICK_S = 0.1


class NotKept(Exception):
    """The ranks could not stop at a common step and save: ``str`` says why (the cell says it)."""


class KeepingWork:
    """The work-keeping half of the supervisor (it provides ``_live``, ``_pump``, the ranks)."""

    _live: Callable[[], list[Any]]
    _pump: Callable[[float | None], None]
    _emit: Callable[[Event], None]
    _stop: Callable[..., None]
    _failures: Callable[[], list[Any]]
    _ranks: dict[int, Any]
    _keeps_work: bool

    def _init_keeping_work(self, keeps_work: bool) -> None:
        self._keeps_work = keeps_work  # every rank of the launch is here, and runs the user's function
        self._steps_passed: dict[int, int] = {}  # STEPS answers
        self._saving: dict[int, str] = {}  # SAVING: the folder each rank writes
        self._stopped: dict[int, tuple[int, str]] = {}  # STOPPED: (steps, folder)
        self._not_kept = ""  # "; why" a stop that tried to keep the work could not

    def _on_stop_frame(self, rank: int, kind: bytes, body: bytes) -> bool:
        """Take a frame of the stop (True), or leave it (False)."""
        if kind == wire.STEPS and self._keeps_work:
            self._steps_passed[rank] = pickle.loads(body)[1]
        elif kind == wire.SAVING:
            steps, folder = pickle.loads(body)
            if not self._saving:
                self._emit(LaunchStopping(f"every rank stopped after {steps} training steps: saving their state "
                                          f"in {folder} (interrupt again to stop at once, leaving it incomplete)"))
            self._saving[rank] = folder
        elif kind == wire.STOPPED:
            self._stopped[rank] = pickle.loads(body)
        else:
            return False
        return True

    def _stop_keeping_work(self, why: str) -> KeptWork | None:
        """Every rank to one common step, saved there: the ``KeptWork``, or None when every rank
        finished by itself meanwhile. Raises ``NotKept`` saying why not (the caller stops the
        plain way); a rank's failure meanwhile is left for the caller to find."""
        if not self._keeps_work:
            raise NotKept("")
        live = [r for r in self._live() if r.failure is None]
        if not live or len(live) != len(self._live()):
            raise NotKept("")
        with counting_interrupts() as presses:
            self._steps_passed.clear()
            for rank in live:
                rank.pipes.send(wire.INTERRUPT, pickle.dumps(("ask",)))
            self._wait(lambda: all(r.finished or r.number in self._steps_passed for r in live), ANSWER_WITHIN_S,
                       presses)
            running = [r for r in live if not r.finished]
            passed = [self._steps_passed.get(r.number, 0) for r in running]
            boundary = agreed_boundary(passed)
            if boundary is None:
                silent = [str(r.number) for r in running if r.number not in self._steps_passed]
                unstarted = [str(r.number) for r, n in zip(running, passed) if not n]
                raise NotKept("" if not any(passed) else
                              f"rank {', '.join(silent)} did not say where it was" if silent else
                              f"rank {', '.join(unstarted)} had taken no training step yet: no common step to save at")
            self._emit(LaunchStopping(f"{why}: every rank finishes training step {boundary} and saves there "
                                      "(interrupt again to stop at once)"))
            for rank in running:
                rank.pipes.send(wire.INTERRUPT, pickle.dumps(("at", boundary)))
            if not self._wait(lambda: self._all_saving(running), REACH_THE_STEP_WITHIN_S, presses):
                late = [r.number for r in running if not r.finished and r.number not in self._saving]
                raise NotKept(f"rank {', '.join(map(str, late))} did not reach training step {boundary} within "
                              f"{REACH_THE_STEP_WITHIN_S:g} s: nothing was saved")
            if not self._wait(lambda: all(r.finished for r in running), SAVE_WITHIN_S, presses):
                folder = next(iter(self._saving.values()), "")
                raise NotKept(f"the checkpoint in {folder} was not finished (stopped while saving): it is "
                              "incomplete, and resume= refuses it")
        if self._failures():
            return None  # a rank failed on the way (a save that raised): the caller reports it
        if all(r.has_result for r in running):
            return None  # they all finished meanwhile: the launch is simply done
        steps, folder = next(iter(self._stopped.values()), (0, ""))
        missing = [r.number for r in running if r.number not in self._stopped]
        if missing:
            raise NotKept(f"rank {', '.join(map(str, missing))} left without saving: the checkpoint in {folder} "
                          "is incomplete")
        return KeptWork(steps, folder)

    def _keep_work_then_stop(self, why: str) -> KeptWork | None:
        """Stop every rank, at one common step with its work saved where they train under nblaunch's
        Accelerator (``keeping_work``), else where they are; the ``KeptWork`` or None."""
        try:
            kept = self._stop_keeping_work(why)
        except NotKept as not_kept:
            if str(not_kept):
                self._not_kept = f"; {not_kept}"
                self._emit(LaunchStopping(str(not_kept)))
            self._stop(STACKS_ON_STOP_S, fallback=True)
            return None
        self._stopping = True
        if self._live():
            self._stop(STACKS_ON_STOP_S if kept is None else 0.0, fallback=kept is None)
        return kept

    def _finished_meanwhile(self) -> bool:
        """Asked to stop, every rank had finished its function anyway: the launch is done."""
        return all(r.has_result and r.failure is None for r in self._ranks.values())

    def _all_saving(self, running: list[Any]) -> bool:
        return all(r.finished or r.number in self._saving for r in running)

    def _wait(self, done: Callable[[], bool], budget: float, presses: Any) -> bool:
        """Pump until ``done()``: False when ``budget`` seconds passed, a second interrupt came or a
        rank failed."""
        end = time.monotonic() + budget
        while not done():
            if presses.count or self._failures() or time.monotonic() >= end:
                if presses.count:
                    raise NotKept("interrupted again: " + ("the checkpoint under way was not finished (it is "
                                                           "incomplete, and resume= refuses it)" if self._saving
                                                           else "nothing was saved"))
                return bool(self._failures())
            self._pump(_TICK_S)
        return True
