"""The objects nblaunch keeps one of per process: made on first use, forgotten in a forked child.

A fork (a rank) copies its parent's objects, with locks that threads it does not have may
hold, launches that are not its own and a launch server whose socket is closed in it. Each such
object of nblaunch's is made here, and the child forgets them all at once
(``os.register_at_fork``): its first call makes its own.

Example::

    preload_here = per_process(Preload)   # at module level: the accessor
    preload_here().preload(wanted)         # this process's Preload
"""

from __future__ import annotations

import os
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

_made: dict[Callable[[], object], object] = {}
_lock = threading.Lock()


def per_process(make: Callable[[], T]) -> Callable[[], T]:
    """An accessor of the one object ``make()`` makes in each process."""

    def this_process() -> T:
        made = _made.get(make)
        if made is None:
            with _lock:
                made = _made.get(make)
                if made is None:
                    made = _made[make] = make()
        return made  # type: ignore[return-value]

    this_process.__doc__ = f"This process's {getattr(make, '__name__', 'object')}."
    return this_process


def _forget_in_child() -> None:
    global _lock
    _made.clear()
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_forget_in_child)
