"""Telling the launcher that a rank's main thread is getting somewhere, so a stall is a stall.

A training loop that prints nothing for minutes is not stuck; a rank waiting in a collective or
sleeping is. The launcher calls a launch stalled when no rank made progress for ``stall_after``
seconds (``nblaunch.launch.supervising.stall``): a line, a bar, a metric, a call's answer, or this
module's ``MOVED`` frame. A bare thread looks at the main thread every quarter of ``stall_after``
(between 0.25 and 5 s): it moved if its innermost Python frame, or the instruction in it, changed
since the last look, or if it spent a quarter of that time on a CPU (a loop that sits in one C
call most of the time looks still, and a long matmul is work, not a stall), or if it is compiling
(``compile_watch``: it may only wait for a compiler process). A rank blocked in a collective's
wait or in ``time.sleep`` is none of these, and sends nothing.

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
from nblaunch.worker import channel, compile_watch

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
    clock = time.pthread_getcpuclockid(main)
    last, cpu = _place(main), time.clock_gettime(clock)
    try:
        channel.send(wire.MOVED, b"")  # the function begins: a start that took long is no stall
    except OSError:
        return
    while True:
        time.sleep(every)
        try:
            place, used = _place(main), time.clock_gettime(clock)
        except OSError:
            return  # the main thread is gone: the rank is leaving
        compile_watch.watch_compiles()  # a user's torch.compile that loaded torch._dynamo since
        if place != last or used - cpu >= every / 4 or compile_watch.compiling():
            try:
                channel.send(wire.MOVED, b"")
            except OSError:
                return  # the launcher is gone
        last, cpu = place, used


def _place(thread: int) -> tuple[int, int, int] | None:
    """Where ``thread`` is: its innermost frame and the instruction in it."""
    frame = sys._current_frames().get(thread)
    return None if frame is None else (id(frame.f_code), id(frame), frame.f_lasti)
