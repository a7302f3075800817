"""``%debug`` on a failed rank: pdb at the frame where the rank raised, with its locals.

A rank that raised in the user's function keeps its frames (``contract/kept_frames``). Here
they become real frames again: for each, a line of code compiled under the rank's file name,
function name and line numbers is run with the rank's locals, each calling the next with
``exec`` (which adds no frame of its own), the innermost raising a copy of the rank's
exception. The traceback that comes out reads as the rank's did, and pdb walks it: ``p``,
``pp``, ``up``, ``down``, ``where``, ``ll`` (the source is this process's: a notebook's cells,
the script's files). Globals are this process's module of the same name (the notebook's
namespace for its cells), copied.

When a launch's error is shown in IPython (``ipython_errors``), :func:`offer` makes the first
rank that raised the one IPython's ``%debug`` opens. :func:`debug` opens another rank, or works
outside IPython. Warm ranks keep a failed call's frames live until their next call: there the
debugger (:class:`RankPdb`, IPython's own with three commands changed) sends ``p``, ``pp`` and
statements to the rank (the error's ``live_frames``), so they read and change the rank's values
as they are now; after a launch they read the values the rank sent.

Example::

    notebook_launcher(train, num_processes=2)     # rank 1 raises
    %debug                                        # (Pdb) p x.shape -> torch.Size([3, 5])
    nblaunch.debug(rank=0)                         # another rank that raised
"""

from __future__ import annotations

import copy
import functools
import pdb
import sys
import types
from typing import Any, Callable

from nblaunch import frames
from nblaunch.contract.failure import RankFailure
from nblaunch.contract.kept_frames import KeptFrame
from nblaunch.launch.errors import RankFailedError

__all__ = ["debug", "offer", "rank_pdb_class", "rebuilt"]

_NEXT, _ERROR, _LIVE = "__nblaunch_next__", "__nblaunch_error__", "__nblaunch_live__"
_offered: list[RankFailedError] = []  # the launch error last shown (and so last offered to %debug)


def offer(error: BaseException) -> None:
    """Make ``error``'s first rank that raised what IPython's ``%debug`` (and ``pdb.pm()``)
    opens; nothing where no rank left frames (a rank killed by a signal)."""
    if not isinstance(error, RankFailedError):
        return
    _offered[:] = [error]
    failure = next((f for f in error.failures if f.frames), None)
    if failure is None:
        return
    try:
        _make_last(failure, getattr(error, "live_frames", None))
    except Exception:  # noqa: BLE001  an offer only: %debug then opens the cell's own frame
        pass


def debug(error: BaseException | None = None, rank: int | None = None) -> None:
    """Open pdb at the frame where ``rank`` (default: the first to raise) raised, in ``error``
    (default: the launch error this process showed last).

    Example::

        nblaunch.debug(rank=1)
        try:
            notebook_launcher(train, num_processes=2)
        except RankFailedError as error:
            nblaunch.debug(error)
    """
    error = error if error is not None else _last_shown()
    if not isinstance(error, RankFailedError):
        print("nblaunch.debug: the last error was not a failed launch's: there is no rank to debug "
              "(pass the RankFailedError you caught: nblaunch.debug(error))")
        return
    failure = _choose(error, rank)
    if failure is None:
        return
    exception, _ = _make_last(failure, getattr(error, "live_frames", None))
    shell = _ipython()
    if shell is not None:
        shell.debugger(force=True)
    else:
        debugger = rank_pdb_class(pdb.Pdb)()
        debugger.reset()
        debugger.interaction(None, exception.__traceback__)


def rebuilt(failure: RankFailure, live: Callable[[int, int, str, str], str | None] | None = None,
            ) -> tuple[BaseException, types.TracebackType]:
    """A copy of ``failure``'s exception, raised through frames made like the rank's, and the
    traceback it came out with (its first entry is this module's, as IPython expects its own
    frame there); the copy's ``__traceback__`` starts at the rank's outermost frame. ``live``:
    how the debugger asks the rank about its frames where it still has them."""
    original = failure.exception or RuntimeError(failure.reason)
    try:
        error = copy.copy(original)
    except Exception:  # noqa: BLE001  an exception that cannot be copied is raised as it is
        error = original
    error.__cause__ = error.__context__ = None
    codes = [(_code(kept, last=i == len(failure.frames) - 1), _globals(kept), kept.values())
             for i, kept in enumerate(failure.frames)]
    for (_, globals_, _), following in zip(codes, codes[1:]):
        globals_[_NEXT] = following
    if live is not None:
        for index, (_, globals_, _) in enumerate(codes):
            globals_[_LIVE] = functools.partial(live, failure.rank, index)
    codes[-1][1][_ERROR] = error
    try:
        exec(*codes[0])
    except BaseException as raised:  # noqa: BLE001
        if raised is not error:
            raise
        head = raised.__traceback__
    error.__traceback__ = head.tb_next
    return error, head


def _make_last(failure: RankFailure, live: Callable[[int, int, str, str], str | None] | None,
               ) -> tuple[BaseException, types.TracebackType]:
    error, head = rebuilt(failure, live)
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, head
    if sys.version_info >= (3, 12):
        sys.last_exc = error
    shell = _ipython()
    if shell is not None and hasattr(shell, "InteractiveTB"):
        shown = shell.InteractiveTB
        shown.tb = head  # what IPython's debugger starts from, if set
        if live is not None and not isinstance(shown.pdb, _RankPdbBase):  # %debug asks the live rank
            shown.pdb = rank_pdb_class(shown.debugger_cls)()
    return error, head


class _RankPdbBase:
    """Marks the debuggers :func:`rank_pdb_class` made."""


def rank_pdb_class(base: type) -> type:
    """``base`` (IPython's debugger, or pdb's) with ``p``, ``pp`` and statements sent to the rank
    where the current frame is a warm rank's that still has it; as ``base`` everywhere else."""

    class RankPdb(base, _RankPdbBase):  # type: ignore[misc, valid-type]
        def _ask(self, kind: str, source: str) -> str | None:
            live = self.curframe.f_globals.get(_LIVE) if self.curframe is not None else None
            return None if live is None else live(kind, source)

        def do_p(self, arg: str) -> None:
            said = self._ask("repr", arg)
            return super().do_p(arg) if said is None else self.message(said)

        def do_pp(self, arg: str) -> None:
            said = self._ask("pformat", arg)
            return super().do_pp(arg) if said is None else self.message(said)

        def default(self, line: str) -> None:
            said = self._ask("exec", line[1:] if line.startswith("!") else line)
            if said is None:
                return super().default(line)
            if said:
                self.message(said.rstrip("\n"))
            return None

    return RankPdb


def _choose(error: RankFailedError, rank: int | None) -> RankFailure | None:
    raised = [f for f in error.failures if f.frames]
    if rank is None:
        if raised:
            return raised[0]
        first = error.failures[0]
        print(f"nblaunch.debug: rank {first.rank} {first.reason}: it left no frames to debug")
        return None
    chosen = next((f for f in error.failures if f.rank == rank), None)
    if chosen is None:
        failed = ", ".join(str(f.rank) for f in error.failures)
        print(f"nblaunch.debug: rank {rank} did not fail in this launch (these did: {failed})")
        return None
    if not chosen.frames:
        print(f"nblaunch.debug: rank {rank} {chosen.reason}: it left no frames to debug")
        return None
    return chosen


def _last_shown() -> BaseException | None:
    last = getattr(sys, "last_value", None)
    if _offered and last is not None and (last is _offered[0] or _is_offered_copy(last)):
        return _offered[0]
    return last


def _is_offered_copy(value: BaseException) -> bool:
    tb = value.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get(_ERROR) is value


def _code(kept: KeptFrame, last: bool) -> types.CodeType:
    """One line at the rank's line number, in a code object named and numbered as its function."""
    line = kept.lineno if isinstance(kept.lineno, int) and kept.lineno > 0 else 1  # None: an instruction of no line
    first = kept.firstlineno if 0 < kept.firstlineno <= line else 1
    statement = f"raise {_ERROR}" if last else f"exec(*{_NEXT})"
    code = compile("\n" * (line - first) + statement, kept.filename, "exec")
    named = code.replace(co_name=kept.function, co_firstlineno=first)
    if sys.version_info >= (3, 11):
        named = named.replace(co_qualname=kept.qualname)
    return named


def _globals(kept: KeptFrame) -> dict[str, Any]:
    """The globals the frame's code sees here: a copy of this process's module of its name (the
    notebook's namespace for a cell's code), or a bare one."""
    shell = _ipython()
    if shell is not None and (kept.module == "__main__" or frames.cell_number(kept.filename) is not None):
        return dict(shell.user_ns)
    module = sys.modules.get(kept.module)
    return dict(vars(module)) if module is not None else {"__name__": kept.module}


def _ipython() -> Any:
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None
