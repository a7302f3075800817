"""What a launch raises, and why.

- :class:`LaunchConfigError`: bad input, raised before any process starts.
- :class:`RankFailedError`: one or more ranks failed; the root cause comes first and the
  original exception (with its remote traceback) is chained as ``__cause__``.
- :class:`LaunchTimeoutError`: ``timeout=`` ran out; carries every rank's stack.
- :class:`LaunchCancelledError`: a non-blocking launch was cancelled.
- :class:`LaunchInterrupted`: interrupted (a ``KeyboardInterrupt``); every rank was stopped.

:func:`failure_from_report` and :func:`failure_from_exit` say how one rank failed, from its
own report or from how its process ended; :func:`root_cause_first` orders a launch's failures.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import signal
from dataclasses import dataclass, field

from nblaunch import frames


class LaunchConfigError(ValueError):
    """The launch was refused before any process started; the message says what to change."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text, chained below the exception."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + frames.name_cells(self.text)


class RemoteError(Exception):
    """Stands in for a worker's exception whose type cannot be rebuilt in the launcher."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message

    def __reduce__(self):  # pickled whole: a detached launch's outcome crosses processes
        return (type(self), (self.type_name, self.message))


@dataclass
class RankFailure:
    """How one rank failed."""

    rank: int
    reason: str  # one line: "ValueError: boom", "killed by SIGKILL (likely out of memory)", ...
    exception: BaseException | None = None  # rebuilt from the worker, chained with its traceback
    traceback: str = ""
    exitcode: int | None = None
    signal_name: str | None = None
    collateral: bool = False  # a communication error that another rank's failure likely caused
    log_tail: list[str] = field(default_factory=list)  # last lines of its output, for crashes
    hint: str = ""  # what to do about it, where nblaunch knows


class RankFailedError(RuntimeError):
    """One or more ranks failed. ``failures[0]`` is the root cause (the first to fail).

    Example::

        try:
            notebook_launcher(train, num_processes=2)
        except RankFailedError as err:
            print(err.root_cause.rank, err.root_cause.reason)
    """

    def __init__(self, failures: list[RankFailure], stacks: dict[int, str] | None = None):
        self.failures = failures
        self.stacks = stacks or {}
        super().__init__(self._message())
        root = failures[0]
        if root.exception is not None and root.exception.__cause__ is None and root.traceback:
            root.exception.__cause__ = RemoteTraceback(root.traceback)  # lost when it was pickled
        self.__cause__ = root.exception  # the rank's own exception, its traceback below it

    def __reduce__(self):  # pickled whole: a detached launch's outcome crosses processes
        return (type(self), (self.failures, self.stacks))

    @property
    def root_cause(self) -> RankFailure:
        return self.failures[0]

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    def _message(self) -> str:
        # The headline; the traceback is not repeated here: it is chained below (``__cause__``).
        first = self.failures[0]
        place = frames.where(first.traceback, with_code=False) if first.traceback else ""
        lines = [f"rank {first.rank} failed: {first.reason}" + (f" ({place})" if place else "")]
        if first.hint:
            lines += ["", first.hint]
        if first.log_tail:
            lines += ["", f"last lines of rank {first.rank}:"] + [f"  {t}" for t in first.log_tail]
        for other in self.failures[1:]:
            note = " (likely a consequence of rank %d)" % first.rank if other.collateral else ""
            lines.append(f"rank {other.rank} also failed{note}: {other.reason}")
        return "\n".join(lines)


class LaunchInterrupted(KeyboardInterrupt):
    """The launch was interrupted (the kernel's ■, Ctrl-C); every rank was stopped first. A
    ``KeyboardInterrupt``, so code that catches that goes on working."""


class LaunchCancelledError(concurrent.futures.CancelledError):
    """A non-blocking launch was stopped with ``cancel()`` (or the widget's Stop button)."""


class LaunchTimeoutError(TimeoutError):
    """The launch ran past ``timeout=``; every rank was stopped. ``stacks`` says where each was."""

    def __init__(self, timeout: float, stacks: dict[int, str]):
        self.timeout = timeout
        self.stacks = stacks
        # One line per rank; the whole stacks are in ``stacks``, the display and the logs.
        where = "\n".join(f"  rank {r}: {frames.where(text) or '(no stack)'}" for r, text in sorted(stacks.items()))
        super().__init__(
            f"the launch did not finish within timeout={timeout:g} s; every rank was stopped."
            + (f"\nWhere the ranks were:\n{where}" if where else "")
        )

    def __reduce__(self):  # pickled whole: a detached launch's outcome crosses processes
        return (type(self), (self.timeout, self.stacks))


def root_cause_first(failures: list[RankFailure], shown_failing: list[int]) -> list[RankFailure]:
    """``failures`` in the order a launch blames them, wherever its ranks ran: a rank's own
    error before the errors a dead peer caused (``collateral``), then in the order the display
    showed the ranks failing (``shown_failing``), so that what the user saw first is what is
    blamed; ranks failing on the same line differ by a millisecond either way. The sort is
    stable: pass ``failures`` in the order they happened."""
    shown = {rank: i for i, rank in enumerate(shown_failing)}
    return sorted(failures, key=lambda f: (f.collateral, shown.get(f.rank, len(shown))))


def failure_from_report(rank: int, report: dict) -> RankFailure:
    exception: BaseException
    try:
        exception = pickle.loads(report["exception"]) if report["exception"] else None
    except Exception:
        exception = None
    if exception is None:
        type_name = report["type"].rsplit(".", 1)[-1]
        exception = RemoteError(type_name, report["reason"].split(": ", 1)[-1])
    if report["traceback"]:
        exception.__cause__ = RemoteTraceback(report["traceback"])
    return RankFailure(
        rank=rank,
        reason=report["reason"],
        exception=exception,
        traceback=report["traceback"],
        collateral=report["collateral"],
        hint=report.get("hint", ""),
    )


def failure_from_exit(rank: int, code: int, tail: list[str]) -> RankFailure:
    if code < 0:
        name = signal.Signals(-code).name
        reason = f"killed by {name}"
        if -code == signal.SIGKILL:
            reason += " (most likely the out-of-memory killer: the machine ran out of memory)"
        return RankFailure(rank, reason, exitcode=code, signal_name=name, log_tail=tail)
    if code == 0:
        return RankFailure(rank, "exited with code 0 without returning (os._exit in the function?)", exitcode=code, log_tail=tail)
    reason = f"exited with code {code}"
    if not tail:
        reason += " without a report and without writing anything"
    return RankFailure(rank, reason, exitcode=code, log_tail=tail)
