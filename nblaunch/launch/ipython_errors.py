"""In IPython (Jupyter, Colab, VS Code), a launch's errors are shown without nblaunch's frames.

IPython's ``__tracebackhide__`` never hides the frame that raised, which for a launch's error
is always nblaunch's own. So the launcher registers a handler for its error types
(``set_custom_exc``) that shows them as IPython would, with every frame of nblaunch's package
left out: the rank's own traceback, then the user's cell line and the headline; then it makes
the rank that raised what ``%debug`` opens (``post_mortem``). A handler someone else registered
is left alone.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Iterator

from nblaunch import frames
from nblaunch.contract.failure import RemoteTraceback
from nblaunch.launch import post_mortem
from nblaunch.launch.errors import (LaunchCancelledError, LaunchConfigError, LaunchInterrupted, LaunchTimeoutError,
                                    RankFailedError)

__all__ = ["install", "without_launcher_frames"]

LAUNCH_ERRORS = (RankFailedError, LaunchTimeoutError, LaunchCancelledError, LaunchConfigError, LaunchInterrupted)


def install() -> None:
    """Register the handler in the running IPython shell, if there is one and it has none."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return
    if getattr(shell, "custom_exceptions", ()) not in ((), LAUNCH_ERRORS):
        return  # the user's (or another library's) handler
    shell.set_custom_exc(LAUNCH_ERRORS, _show)


def _show(shell: Any, etype: type, value: BaseException, tb: types.TracebackType | None,
          tb_offset: int | None = None) -> None:
    with _rank_frames_as_cause(value):
        shell.showtraceback((etype, value, without_launcher_frames(tb)), tb_offset=tb_offset)
    post_mortem.offer(value)  # %debug in the next cell opens the rank that raised


@contextlib.contextmanager
def _rank_frames_as_cause(error: BaseException) -> Iterator[None]:
    """While ``error`` is shown, chain the rank's traceback to it directly: one chain, the rank's
    frames (ending in its exception's line), then the headline. The rank's exception, rebuilt
    here, was never raised in this process and has no frame of it: shown as a hop of its own, it
    would be an empty "Traceback (most recent call last)" between the two. The chain code reads
    (``error.__cause__``, and its ``__cause__``) is as it was once the error is shown."""
    cause = error.__cause__
    remote = getattr(cause, "__cause__", None)
    if cause is None or cause.__traceback__ is not None or not isinstance(remote, RemoteTraceback):
        yield
        return
    error.__cause__ = remote
    try:
        yield
    finally:
        error.__cause__ = cause


def without_launcher_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The same traceback with the frames of nblaunch's package taken out."""
    kept = []
    while tb is not None:
        if not frames.is_launcher_code(tb.tb_frame.f_code.co_filename):
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt
