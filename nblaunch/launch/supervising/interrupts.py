"""An interrupt that comes while the launch is already stopping on one waits for the stop to end
(or, while the ranks stop at a common step to keep their work, is counted: ``counting_interrupts``).
While the launch runs, an interrupt is raised at the top of the supervisor's loop
(``DeferredInterrupts``), never half-way through handling what it read from a rank: a line read
from a pipe and not yet shown or logged would be lost.

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
import os
import signal
import threading
from typing import Callable, Iterator


_NOT_REPLACED = object()


def _replace_sigint(handler: Callable[[int, object], None]) -> object:
    """Install ``handler`` for SIGINT and return the one it replaced (Python's own where C code had
    set it); ``_NOT_REPLACED`` where this thread cannot (only the main thread may, and no SIGINT
    reaches another anyway)."""
    if threading.current_thread() is not threading.main_thread():
        return _NOT_REPLACED
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # a thread of an embedded interpreter that cannot set handlers
        return _NOT_REPLACED
    return signal.default_int_handler if previous is None else previous


def _restore_sigint(previous: object) -> None:
    if previous is not _NOT_REPLACED:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _sigint_handled_by(handler: Callable[[int, object], None]) -> Iterator[None]:
    previous = _replace_sigint(handler)
    try:
        yield
    finally:
        _restore_sigint(previous)


@contextlib.contextmanager
def interrupts_wait() -> Iterator[None]:
    """Hold SIGINT off for the block (main thread only: elsewhere none is delivered anyway)."""
    # The interrupt already being answered is all a second one could ask for.
    with _sigint_handled_by(lambda signum, frame: None):
        yield


class _Presses:
    count = 0


@contextlib.contextmanager
def counting_interrupts() -> Iterator[_Presses]:
    """SIGINT counted instead of raised for the block (main thread only): a loop that waits reads
    ``.count`` and decides, so an interrupt never lands half-way through reading a frame."""
    presses = _Presses()

    def press(signum: int, frame: object) -> None:
        presses.count += 1

    with _sigint_handled_by(press):
        yield presses


class DeferredInterrupts:
    """SIGINT noted and the supervisor's select woken (a byte to ``wake_fd``); the loop raises it
    with :meth:`raise_if_pressed` where nothing is half handled. Main thread only; ``restore`` puts
    the previous handler back. Example::

        deferred = DeferredInterrupts(wake_fd)
        try:
            while running():
                deferred.raise_if_pressed()
                pump()
        finally:
            deferred.restore()
    """

    def __init__(self, wake_fd: int) -> None:
        self.pressed = False
        self._wake_fd = wake_fd
        self._previous = _NOT_REPLACED
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # SIG_IGN or another's: left alone
            self._previous = _replace_sigint(self._press)

    def _press(self, signum: int, frame: object) -> None:
        self.pressed = True
        try:
            os.write(self._wake_fd, b"i")
        except OSError:  # the pipe is full: the select wakes anyway
            pass

    def raise_if_pressed(self) -> None:
        if self.pressed:
            self.pressed = False
            raise KeyboardInterrupt

    def restore(self) -> None:
        _restore_sigint(self._previous)
        self._previous = _NOT_REPLACED
