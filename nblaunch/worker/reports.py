"""How a rank tells the launcher that it failed, in its function or before it could run it.

A report is a :class:`~nblaunch.contract.failure.RankFailure`, pickled, on the event pipe; the
launcher numbers it by the pipe it came on. Everything here must work whatever the exception
does: its ``__str__`` may raise, it may not pickle, formatting its traceback reads source files
that may be slow.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import time
import traceback
from types import TracebackType

from nblaunch import wire
from nblaunch.contract import kept_frames
from nblaunch.contract.failure import NOT_NUMBERED, Phase, RankFailure
from nblaunch.worker import channel
from nblaunch.worker.streams import flush_streams

# Text in messages of errors that a rank gets because a peer died, not because of its own bug.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "Socket Timeout",
)


def describe(error: BaseException) -> str:
    """``"ValueError: boom"``, even for an exception whose ``__str__`` raises."""
    name = type(error).__name__
    try:
        text = str(error)
    except BaseException as inner:
        text = f"<its message could not be shown: str() raised {type(inner).__name__}>"
    return f"{name}: {text}" if text else name


def format_traceback(error: BaseException) -> str:
    """The traceback as Python prints it, from the user's function or script on (the frames of
    nblaunch, and of runpy starting a script, that led there are left out); the frames alone if
    printing the message fails."""
    start = kept_frames.user_start(error.__traceback__)
    try:
        return "".join(traceback.format_exception(type(error), error, start))
    except BaseException:
        listed = "".join(traceback.format_tb(start))
        return f"Traceback (most recent call last):\n{listed}{describe(error)}\n"


def caused_by_peer(error: BaseException) -> bool:
    """True for communication errors that another rank's death most likely caused."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if dist_error is not None and isinstance(error, dist_error):
        return True
    message = describe(error)
    return any(marker in message for marker in _PEER_GONE)


def send_failure(error: BaseException, reason: str | None = None, *, phase: Phase = Phase.RUNNING, hint: str = "",
                 fd: int | None = None) -> None:
    """Report a failure in two frames: what and when at once, then the traceback.

    Formatting a traceback reads source files (linecache) and pickling runs arbitrary code;
    either can stall (a disk under load was seen to). The first frame lets the launcher stop
    the other ranks at once; it then waits a moment for the second. What the rank printed
    goes out first: a rank stopped while formatting its traceback still leaves its last lines.
    """
    flush_streams()
    first = failure_record(error, reason, phase=phase, hint=hint, whole=False)
    channel.send(wire.ERROR, pickle.dumps(first), fd=fd)
    # Pickling the record pickles the exception, bounded (contract.failure): a big or broken one
    # leaves its type, message and traceback.
    whole = dataclasses.replace(failure_record(error, reason, phase=phase, hint=hint), failed_at=first.failed_at)
    channel.send(wire.ERROR, pickle.dumps(whole), fd=fd)


def failure_record(error: BaseException, reason: str | None = None, *, phase: Phase = Phase.RUNNING,
                   hint: str = "", whole: bool = True) -> RankFailure:
    """The record of ``error``: whole (its exception, its traceback formatted from the user's code
    on, and, where it raised in the user's function, its frames with their locals for the
    debugger and the failing line's locals under it in the traceback), or first (what and when only, which
    cannot stall)."""
    kept = _kept_frames(error) if whole and phase is Phase.RUNNING else []
    return RankFailure(
        rank=NOT_NUMBERED,
        reason=reason or describe(error),
        exception=error if whole else None,
        traceback=_bounded_text(kept_frames.with_locals(format_traceback(error), kept)) if whole else "",
        frames=kept,
        complete=whole,
        phase=phase,
        type_name=f"{type(error).__module__}.{type(error).__qualname__}",
        hint=hint,
        collateral=caused_by_peer(error),
        failed_at=time.monotonic(),  # system-wide clock: the launcher orders failures of all ranks by it
    )


def _kept_frames(error: BaseException) -> list[kept_frames.KeptFrame]:
    """The frames for the debugger; none where keeping them fails: the report must go whatever
    the locals are (a tensor subclass whose ``device`` raises, a value that hangs when read)."""
    try:
        return kept_frames.keep(error.__traceback__)
    except Exception:  # noqa: BLE001
        return []


_TRACEBACK_MAX_CHARS = 200_000


def _bounded_text(text: str) -> str:
    if len(text) <= _TRACEBACK_MAX_CHARS:
        return text
    half = _TRACEBACK_MAX_CHARS // 2
    return f"{text[:half]}\n... ({len(text) - 2 * half} characters left out) ...\n{text[-half:]}"


# What the user can do about a failure outside the function, where there is something.
_PHASE_HINTS = {
    Phase.LOADING: (
        "A spawned rank rebuilds the function and its arguments by importing, by name, the modules "
        "they come from. Make every such module importable in a fresh interpreter (installed, or its "
        "folder on sys.path before the launch), or define the function in the notebook; with no CUDA "
        "initialised in the notebook, start_method='fork' avoids rebuilding altogether."
    ),
}
_DEFAULT_HINT = (
    "This happened in nblaunch's code around your function, not in it: please report it with this "
    "traceback. A library that replaces sys.stdout, sys.stderr or logging's handlers is the usual suspect."
)


def hint_for(phase: Phase) -> str:
    """What to do about a failure in ``phase``, outside the user's function."""
    return _PHASE_HINTS.get(phase, _DEFAULT_HINT)


class RankGuard:
    """Reports any exception raised in a rank outside the user's function, then ends the rank
    with code 70.

    Without it a rank that fails before the user's function (attaching its streams, rebuilding a
    spawned function) would exit with nothing said. The report goes on the event pipe; if that
    fails too, the traceback is written to the rank's stderr pipe, which the launcher shows.

    Example::

        with RankGuard(event_fd, stderr_fd) as guard:
            guard.phase = Phase.ATTACHING
            attach_streams(...)
    """

    def __init__(self, event_fd: int | None, stderr_fd: int):
        self.event_fd = event_fd
        self.stderr_fd = stderr_fd  # becomes 2 once the streams are attached
        self.phase = Phase.JOINING

    def __enter__(self) -> "RankGuard":
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> bool:
        if error is None:
            return False
        try:
            self._report(error)
        finally:
            os._exit(70)

    def _report(self, error: BaseException) -> None:
        reason = f"{self.phase.value}: {describe(error)}"
        hint = hint_for(self.phase)
        if self.event_fd is not None:
            try:
                send_failure(error, reason, phase=self.phase, hint=hint, fd=self.event_fd)
                return
            except BaseException:
                pass
        text = f"nblaunch: this rank {reason}\n{format_traceback(error)}{hint}\n"
        try:
            wire.write_all(self.stderr_fd, text.encode("utf-8", "backslashreplace"))
        except OSError:
            pass
