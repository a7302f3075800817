"""Telling the launcher when a rank is compiling (``torch.compile``), so its row says
"compiling" and a 30-second compile is not taken for a stall.

Dynamo calls its compile callbacks around every compile (the outermost start and end of nested
ones). They are registered once per rank where ``torch._dynamo`` is loaded: at the function's
start (it usually is, imported ahead), by ``prepare`` when it compiles, and by the stall look-out
at each look (a user's own ``torch.compile`` that loaded it later). While a rank compiles, the
look-out reports it moving even when its main thread only waits for a compiler process.

Example::

    watch_compiles()      # no-op until torch._dynamo is loaded; then once per process
    compiling()           # True between a compile's start and its end
"""

from __future__ import annotations

import pickle
import sys
import time

from nblaunch import wire
from nblaunch.worker import channel

__all__ = ["watch_compiles", "compiling"]

_registered = False
_since: float | None = None  # when the compile going on began (time.monotonic())


def watch_compiles() -> None:
    """Register the compile callbacks once, where torch._dynamo is fully loaded."""
    global _registered
    if _registered:
        return
    callback = sys.modules.get("torch._dynamo.callback")
    if callback is None or getattr(getattr(callback, "__spec__", None), "_initializing", False):
        return
    if "torch._dynamo" not in sys.modules or not hasattr(callback, "on_compile_end"):
        return
    _registered = True
    callback.on_compile_start(_started)
    callback.on_compile_end(_ended)


def compiling() -> bool:
    return _since is not None


def _started(*_: object) -> None:
    global _since
    _since = time.monotonic()
    _tell(True, 0.0)


def _ended(*_: object) -> None:
    global _since
    seconds = 0.0 if _since is None else time.monotonic() - _since
    _since = None
    _tell(False, seconds)


def _tell(compiling_now: bool, seconds: float) -> None:
    try:
        channel.send(wire.COMPILING, pickle.dumps((compiling_now, seconds)))
    except OSError:  # the launcher is gone; the rank's own end follows
        pass
