"""Telling the launcher that a rank's main thread is getting somewhere, so a stall is a stall.

A training loop that prints nothing for minutes is not stuck; a rank waiting in a collective or
sleeping is. The launcher calls a launch stalled when no rank made progress for ``stall_after``
seconds (``nblaunch.launch.supervising.stall``): a line, a bar, a metric, a call's answer, or this
module's ``MOVED`` frame. A bare thread looks at where the main thread is every quarter of
``stall_after`` (between 0.25 and 5 s): if its innermost Python frame, or the instruction in it,
changed since the last look, the rank moved. A rank blocked in one C call (a collective's wait,
``time.sleep``) stays where it is and sends nothing; a loop, however quiet, moves.

Example (the bootstrap, once the user's function is about to run)::

    watch_main_thread()   # no-op unless the launch set NBLAUNCH_STALL_AFTER
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
import time

from nblaunch import wire
from nblaunch.contract import variables as v
from nblaunch.worker import channel

_LOOK_EVERY_S = (0.25, 5.0)  # bounds of a quarter of stall_after


def watch_main_thread() -> None:
    """Start the look-out thread where the launch watches for stalls."""
    try:
        stall_after = float(os.environ.get(v.STALL_AFTER, ""))
    except ValueError:
        return
    every = min(max(stall_after / 4, _LOOK_EVERY_S[0]), _LOOK_EVERY_S[1])
    _thread.start_new_thread(_look_out, (threading.main_thread().ident, every))


def _look_out(main: int, every: float) -> None:
    last = _place(main)
    while True:
        time.sleep(every)
        place = _place(main)
        if place != last:
            try:
                channel.send(wire.MOVED, b"")
            except OSError:
                return  # the launcher is gone
        last = place


def _place(thread: int) -> tuple[int, int, int] | None:
    """Where ``thread`` is: its innermost frame and the instruction in it."""
    frame = sys._current_frames().get(thread)
    return None if frame is None else (id(frame.f_code), id(frame), frame.f_lasti)
