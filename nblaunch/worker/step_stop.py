"""Stopping every rank at one common step: an interrupt that keeps the work, for launches and
warm calls alike.

Ranks that train with a collective every step cannot each stop wherever an interrupt finds them:
one would stop in step 12's forward while another waits in step 12's all-reduce for it, for ever.
So an interrupt is a small agreement over step boundaries (``accelerator.backward`` calls
:func:`step_boundary` first thing). The launcher asks every rank how many boundaries it has
passed; each answers and holds at its next boundary. Ranks that train together are at most one
boundary apart, so the launcher picks :func:`agreed_boundary` (one more than the most any rank
passed) and tells them; each goes on to that boundary. Every rank has then taken the same
optimizer steps. What happens there depends on the call:

- a warm call raises ``CellInterrupted`` at the boundary: the pool keeps everything in memory;
- a launch *keeps the work* (``begin_call(keeps_work=True)``, where the training side registered
  a keeper with :func:`keep_work_with`): the step under way is finished first (with gradient
  accumulation, the rest of its window: a stop inside one would lose what it accumulated), and the
  rank stops at the step's end (:func:`step_end`, which the prepared DataLoader the loop iterates
  calls before it fetches the next batch, or as it begins the next epoch after the epoch's last batch,
  so that the loop's body and its end-of-epoch code run first; the next boundary if no prepared
  loader is read), where the Accelerator saves its state; then ``RunStopped`` says where, and the
  rank leaves without a result.

A call with no boundaries (no training loop) is stopped at once: each warm rank's main thread gets
SIGINT, so a ``time.sleep`` or a slow loop raises where it is (a launch's ranks are stopped by the
launcher instead). The training side's resume (``resume=`` of a launch) runs at the first boundary
or step end of the rank (:func:`before_first_step`), before any step is taken.

Example (what the watch thread, the launcher and the user's loop do)::

    begin_call(0, keeps_work=True)   # a launch's rank, before the function
    interrupt(("ask",))              # the launcher asks: the answer is STEPS with the count
    interrupt(("at", agreed_boundary([12, 13])))   # 14
    step_boundary()                  # from Accelerator.backward
    step_end()                       # from the prepared DataLoader: saves, raises RunStopped
"""

from __future__ import annotations

import pickle
import signal
import threading
import weakref
from typing import Any, Callable

from nblaunch import wire
from nblaunch.worker import channel

_HOLD_BACKSTOP_S = 60.0  # a rank held at a boundary goes on if the launcher never answers

_lock = threading.Lock()  # the count and the hold change together, on two threads
# No stop asked, agreed or waiting for its step's end: how each call begins and ends.
# ``window_ended``: the last step ended its gradient accumulation window (a stop waits for that).
_NO_STOP: dict[str, Any] = {"hold_at": None, "stop_at": None, "pending": False, "pending_for": None,
                            "window_ended": True}
_state: dict[str, Any] = {"running": False, "call_id": 0, "steps": 0, "keeps_work": False, "first_done": False,
                          **_NO_STOP}
_go_on = threading.Event()
# The training side's hooks, as weak references to bound methods of its Accelerator: holding them
# here must not keep an Accelerator (and the models it prepared) alive after the user lets it go.
# The saver: (steps, announce) -> the checkpoint's folder; it calls announce(folder) before it
# writes, so the cell can say where it saves while it does.
_keeper: list[weakref.WeakMethod] = []
_first_step: list[weakref.WeakMethod] = []  # the training side's resume, before the first step


class CellInterrupted(KeyboardInterrupt):
    """The cell was interrupted: raised in a rank where the launcher asked it to stop."""


class RunStopped(KeyboardInterrupt):
    """A launch's rank stopped at the agreed step after saving its state in ``checkpoint``."""

    def __init__(self, steps: int, checkpoint: str) -> None:
        super().__init__(f"stopped after {steps} training steps; its state is saved in {checkpoint}")
        self.steps = steps
        self.checkpoint = checkpoint


def agreed_boundary(passed: list[int]) -> int | None:
    """Where every rank stops: one more than the most boundaries any rank passed; None when a
    rank passed none (it trains no loop here: nothing to agree on)."""
    return max(passed) + 1 if passed and all(passed) else None


def keep_work_with(keeper: Callable[[int, Callable[[str], None]], str]) -> None:
    """The training side's saver, a bound method, called at the stop with the steps taken and a
    function to call with the folder before writing; returns where it saved (the Accelerator
    registers its own when it is made: one per process). Held weakly."""
    _keeper[:] = [weakref.WeakMethod(keeper)]


def before_first_step(hook: Callable[[], object]) -> None:
    """Run ``hook()``, a bound method, once, at the rank's first boundary or step end (the
    Accelerator's resume). Held weakly."""
    _first_step[:] = [weakref.WeakMethod(hook)]
    _state["first_done"] = False


def _hook(hooks: list[weakref.WeakMethod]) -> Callable | None:
    """The registered hook, or None when none was or its Accelerator is gone."""
    return hooks[0]() if hooks else None


def install() -> None:
    """SIGINT raises in a call and is ignored between calls (on a warm rank's main thread, which
    the "now" interrupt signals: a forked rank's is not the thread this module was imported on)."""
    _state["main_thread"] = threading.get_ident()
    signal.signal(signal.SIGINT, _on_sigint)


def begin_call(call_id: int, keeps_work: bool = False) -> None:
    with _lock:
        _state.update(_NO_STOP, running=True, call_id=call_id, steps=0, keeps_work=keeps_work)
        _go_on.clear()


def end_call() -> None:
    with _lock:
        _state.update(_NO_STOP, running=False)


def step_boundary(window_ends: bool = True, loader: Any = None) -> None:
    """A step of training begins its backward pass: the place an interrupt may stop a rank.
    ``window_ends``: this step ends its gradient accumulation window (its gradients are synced);
    ``loader``: the prepared DataLoader the loop iterates (its next batch ends the step)."""
    _first_step_once()
    if _state["pending"] and _state["window_ended"]:
        # Agreed earlier, and no prepared loader marked the end of that step (or of the window it
        # was in): the steps before this one are whole, so stop before it.
        _stop_keeping_work()
    _state["window_ended"] = window_ends
    with _lock:
        _state["steps"] += 1
        hold = _state["hold_at"] is not None and _state["steps"] >= _state["hold_at"]
    if hold:
        _go_on.wait(_HOLD_BACKSTOP_S)  # SIGINT ("now") interrupts the wait too
    with _lock:
        stop = _state["stop_at"] is not None and _state["steps"] >= _state["stop_at"] and _state["running"]
        if stop:
            _state["stop_at"] = None
            if _state["keeps_work"] and _hook(_keeper) is not None:
                _state["pending"] = True  # this step is finished first (its window too, with accumulation)
                _state["pending_for"] = loader  # the loop's body ends when this loader is read again
                return
    if stop:
        raise CellInterrupted(f"interrupted after {_state['steps'] - 1} training steps of this cell, as every rank was")


def step_end(loader: Any = None) -> None:
    """The step before is over (``loader``, a prepared DataLoader, is asked for its next batch, or
    begins an epoch): a launch agreed to stop stops here, if ``loader`` fed that step. Another
    loader (an evaluation inside the loop's body) does not stop it: the body ends first. Inside a
    gradient accumulation window (the last boundary said its step did not end one) the stop waits
    for the window's end, so the gradients accumulated so far are not lost."""
    _first_step_once()
    if _state["pending"] and _state["window_ended"] and (loader is None or _state["pending_for"] in (None, loader)):
        _stop_keeping_work()


def interrupt(request: tuple) -> None:
    """The launcher's INTERRUPT frame, on the watch thread: ("ask",), ("at", boundary), ("now",)."""
    with _lock:
        if not _state["running"]:
            return
        if request[0] == "ask":
            _state["hold_at"] = _state["steps"] + 1
            channel.send(wire.STEPS, pickle.dumps((_state["call_id"], _state["steps"])))
            return
        _state["hold_at"] = None
        if request[0] == "at":
            _state["stop_at"] = request[1]
        _go_on.set()
    if request[0] == "now":
        signal.pthread_kill(_state["main_thread"], signal.SIGINT)  # wakes a sleep, unlike interrupt_main


def _first_step_once() -> None:
    if not _state["first_done"]:
        hook = _hook(_first_step)
        if hook is not None:
            _state["first_done"] = True
            hook()


def _stop_keeping_work() -> None:
    _state.update(_NO_STOP)
    steps = _state["steps"]
    keeper = _hook(_keeper)  # alive: its Accelerator drives the loop that reached this step
    checkpoint = keeper(steps, lambda folder: channel.send(wire.SAVING, pickle.dumps((steps, folder))))
    raise RunStopped(steps, checkpoint)  # every rank at once: saving has collectives of its own


def _on_sigint(signum: int, frame: Any) -> None:
    if _state["running"]:
        raise CellInterrupted("interrupted")
