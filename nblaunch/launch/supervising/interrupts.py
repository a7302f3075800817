"""An interrupt that comes while the launch is already stopping on one waits for the stop to end.

Ctrl-C twice (or the kernel's stop button pressed again) would cut the stop short: the stacks
not yet answered and the ranks' last lines would be lost from the report. The stop is bounded
(a few seconds at most), so a second interrupt is held until it is over; the launch then raises
``LaunchInterrupted``, as the first interrupt asked.

Example::

    with interrupts_wait():
        stop_every_rank()   # a KeyboardInterrupt cannot land in here
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def interrupts_wait() -> Iterator[None]:
    """Hold SIGINT off for the block (main thread only: elsewhere none is delivered anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:  # the interrupt already being answered is all a second one could ask for
        previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    except ValueError:  # a thread of an embedded interpreter that cannot set handlers
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
