"""How a call on warm ranks begins in its cell, and what a finished one shows, and what it returns or raises.

Every rank answered: with its value, or with the error its call raised. Values come back as a
list in rank order; errors are raised as a launch raises them (``RankFailedError``: the first
rank's traceback, the others in one line each, the ranks a released collective failed marked as
consequences), and an interrupted call raises ``LaunchInterrupted``, saying where the ranks
stopped. Either way the ranks, their process group and what they hold stay.

Example::

    results = finish_call(call, settling, shown, elapsed, only=None)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from nblaunch.events import Display, LaunchFinished, RankFinished, RankStarted, RankState
from nblaunch.launch.errors import LaunchInterrupted, RankFailedError

_KEPT = "the warm ranks and what they hold stay"


def show_start(shown: Display, router: Any, function: Callable) -> None:
    """The call's first events in its cell: the plan (warm ranks: since when, how many calls), the ranks."""
    start = dataclasses.replace(router.started, function_name=getattr(function, "__name__", "call"))
    if router.calls_before:  # the ranks were not started for this call: say what they are
        start = dataclasses.replace(start, start_method="warm", start_reason=(
            f"up since {router.up_since}, {router.calls_before} earlier "
            f"call{'s' if router.calls_before != 1 else ''}; started by {router.started.start_method}"))
    shown.on_event(start)
    for rank, pid in sorted(router.pids.items()):
        shown.on_event(RankStarted(rank=rank, pid=pid))


def finish_call(call: Any, settling: Any, shown: Display, elapsed: float, only: tuple[int, ...] | None) -> list[Any]:
    """Show the call's end in ``shown``; return its values, or raise its error."""
    ranks = [r for r in range(call.num_ranks) if only is None or r in only]
    failures = {r: f for r, f in call.failures.items() if r in ranks}
    for rank in ranks:
        failure = failures.get(rank)
        if failure is None:
            shown.on_event(RankFinished(rank=rank, state=RankState.DONE, exitcode=0))
        else:
            detail = "\n".join(filter(None, [failure.reason, failure.traceback.rstrip()]))
            state = RankState.STOPPED if _is_interrupt(failure) else RankState.FAILED
            shown.on_event(RankFinished(rank=rank, state=state, detail=detail))
    if settling.interrupted:
        # The agreed boundary is the backward pass of one more step than any rank began: every
        # rank has taken one step fewer, which is what a loop's own counter reads.
        where = (f"every rank stopped after {settling.stop_step - 1} training steps of this cell, as the next began "
                 "its backward pass" if settling.stop_step is not None else "each rank stopped where it was")
        error: BaseException = LaunchInterrupted(f"the cell was interrupted: {where}; {_KEPT}")
        shown.on_event(LaunchFinished(RankState.STOPPED, elapsed, error=error,
                                      summary=f"interrupted after {elapsed:.2f} s: {where}; {_KEPT}"))
        raise error
    if failures:
        in_time_order = sorted(failures.values(), key=lambda f: f.failed_at or 0.0)
        finished = [r for r in ranks if r in call.results]
        error = RankFailedError.blaming(in_time_order, {}, [], finished)
        root = error.root_cause
        shown.on_event(LaunchFinished(RankState.FAILED, elapsed, error=error, root_cause_rank=root.rank,
                                      summary=f"rank {root.rank} failed after {elapsed:.2f} s: {root.reason}; {_KEPT}"))
        raise error
    results = [call.results[r] for r in ranks]
    shown.on_event(LaunchFinished(RankState.DONE, elapsed, results=results,
                                  summary=f"{_ranks_done(ranks, call.num_ranks)} done in {elapsed:.3f} s (warm)"))
    return results


def _is_interrupt(failure: Any) -> bool:
    return isinstance(failure.exception, KeyboardInterrupt) or failure.type_name.endswith("CellInterrupted")


def _ranks_done(ranks: list[int], num_ranks: int) -> str:
    if len(ranks) == num_ranks:
        return f"all {num_ranks} ranks"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {num_ranks}"
