"""Stopping a warm rank's call where every rank can stop: an interrupt that keeps the pool.

A kernel's interrupt stops a cell and keeps its variables. Warm ranks that train with a
collective every step cannot each stop wherever the interrupt finds them: one would stop in
step 12's forward while another waits in step 12's all-reduce for it, for ever. So an interrupt
is a small agreement over step boundaries (``accelerator.backward`` calls :func:`step_boundary`
first thing). The launcher asks every rank how many boundaries it has passed in this call; each
answers and holds at its next boundary. Ranks that train together are at most one boundary
apart, so the launcher picks one more than the most any rank passed and tells them; each goes on
to that boundary and raises ``KeyboardInterrupt`` there. Every rank has then taken the same
optimizer steps, and the next call goes on from there. A call with no boundaries (no training
loop) is stopped at once: each rank's main thread gets SIGINT, so a ``time.sleep`` or a slow loop
raises where it is.

Example (what the watch thread and the user's loop do)::

    begin_call()                 # the call loop, before the call
    interrupt(("ask",))          # the launcher asks: the answer is STEPS with the count
    interrupt(("at", 13))        # the 13th boundary raises KeyboardInterrupt
    step_boundary()              # from Accelerator.backward
"""

from __future__ import annotations

import pickle
import signal
import threading
from typing import Any

from nblaunch import wire
from nblaunch.worker import channel

_HOLD_BACKSTOP_S = 60.0  # a rank held at a boundary goes on if the launcher never answers

_lock = threading.Lock()  # the count and the hold change together, on two threads
_state: dict[str, Any] = {"running": False, "call_id": 0, "steps": 0, "hold_at": None, "stop_at": None}
_go_on = threading.Event()


class CellInterrupted(KeyboardInterrupt):
    """The cell was interrupted: raised in a rank where the launcher asked it to stop."""


def install() -> None:
    """SIGINT raises in a call and is ignored between calls (on a warm rank's main thread, which
    the "now" interrupt signals: a forked rank's is not the thread this module was imported on)."""
    _state["main_thread"] = threading.get_ident()
    signal.signal(signal.SIGINT, _on_sigint)


def begin_call(call_id: int) -> None:
    with _lock:
        _state.update(running=True, call_id=call_id, steps=0, hold_at=None, stop_at=None)
        _go_on.clear()


def end_call() -> None:
    with _lock:
        _state.update(running=False, hold_at=None, stop_at=None)


def step_boundary() -> None:
    """A step of training begins its backward pass: the place an interrupt may stop a rank."""
    with _lock:
        _state["steps"] += 1
        hold = _state["hold_at"] is not None and _state["steps"] >= _state["hold_at"]
    if hold:
        _go_on.wait(_HOLD_BACKSTOP_S)  # SIGINT ("now") interrupts the wait too
    with _lock:
        stop = _state["stop_at"] is not None and _state["steps"] >= _state["stop_at"] and _state["running"]
        if stop:
            _state["stop_at"] = None
    if stop:
        raise CellInterrupted(f"interrupted after {_state['steps'] - 1} training steps of this cell, as every rank was")


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


def _on_sigint(signum: int, frame: Any) -> None:
    if _state["running"]:
        raise CellInterrupted("interrupted")
