"""How one rank failed: the typed record a rank sends when it fails, and the launcher reads.

A rank builds a :class:`RankFailure` around its exception (``worker/reports``) and sends it,
pickled, on its event pipe; the launcher builds one itself from how a process ended (an exit
code, a signal). The same record then travels on: from a Ray node's agent to the driver, from a
detached supervisor to the kernel, inside ``RankFailedError``. However it crosses, the exception
crosses as bytes of its own, bounded in size, and is rebuilt on the other side when it can be;
where it cannot (a class only the rank could import), a :class:`RemoteError` stands in with its
type name and message. The rank's traceback, as text, is chained below it.

Example::

    failure = RankFailure(rank=1, reason="ValueError: boom", exception=ValueError("boom"))
    pickle.loads(pickle.dumps(failure)).exception   # ValueError('boom'), its traceback chained
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, field
from typing import Any

from nblaunch import frames
from nblaunch.contract.limited_pickle import pickle_within
from nblaunch.contract.kept_frames import KeptFrame

__all__ = ["Phase", "RankFailure", "RemoteError", "RemoteTraceback", "NOT_NUMBERED"]

NOT_NUMBERED = -1  # a rank's own report: the launcher numbers it by the pipe it came on


class Phase(str, enum.Enum):
    """Where a rank was when it failed. Outside the function, the value starts the failure's
    one-line reason ("could not start (joining its process group): OSError: ...")."""

    JOINING = "could not start (joining its process group)"
    ATTACHING = "could not start (attaching its output to the launcher)"
    LOADING = "could not start (loading the function and its arguments)"
    SETTING_UP = "could not start (setting up the rank)"
    RUNNING = "failed in the function"
    WATCHING = "failed in nblaunch's control thread"
    REPORTING = "failed outside the function (sending its outcome back)"
    ENDED = "its process ended"  # the launcher's own finding: an exit code, a signal, a lost node


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

    rank: int  # the launcher's number for it (a rank's own report: NOT_NUMBERED)
    reason: str  # one line: "ValueError: boom", "killed by SIGKILL (likely out of memory)", ...
    exception: BaseException | None = None  # rebuilt from the worker, chained with its traceback
    traceback: str = ""
    phase: Phase = Phase.RUNNING
    type_name: str = ""  # the rank's exception's module.qualname ("" where the launcher found the failure)
    hint: str = ""  # what to do about it, where nblaunch knows
    collateral: bool = False  # a communication error that another rank's failure likely caused
    failed_at: float | None = None  # CLOCK_MONOTONIC (one clock for every process of a machine)
    complete: bool = True  # False: the first of a report's two frames; the traceback follows
    exitcode: int | None = None
    signal_name: str | None = None
    log_tail: list[str] = field(default_factory=list)  # last lines of its output, for crashes
    frames: list[KeptFrame] = field(default_factory=list)  # where it raised in the function, for pdb
    device_lost: str = ""  # a warm rank's GPU failed after the error (what CUDA said): its context is gone

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["exception"] = _pickled_exception(self.exception)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        blob = state.pop("exception")
        self.__dict__.update(state)
        self.exception = self._rebuilt(blob)

    def _rebuilt(self, blob: bytes | None) -> BaseException | None:
        """The exception from ``blob``, or a stand-in where the rank raised one that cannot be
        rebuilt here (or has not been sent yet); its traceback chained below it."""
        exception = None
        if blob is not None:
            try:
                exception = pickle.loads(blob)
            except Exception:
                exception = None
        if exception is None and self.type_name:
            exception = RemoteError(self.type_name.rsplit(".", 1)[-1], self.reason.split(": ", 1)[-1])
        if exception is not None and self.traceback:
            exception.__cause__ = RemoteTraceback(self.traceback)
        return exception


# An exception may carry anything (a 400 MB tensor): the record must arrive whatever it holds.
_EXCEPTION_MAX_BYTES = 4 << 20  # beyond this, its type, message and traceback only


def _pickled_exception(error: BaseException | None) -> bytes | None:
    """The exception, pickled, if it is small and can be rebuilt; else None."""
    return None if error is None else pickle_within(error, _EXCEPTION_MAX_BYTES)
