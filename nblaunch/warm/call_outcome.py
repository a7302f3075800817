"""How a call on warm ranks begins in its cell, and what a finished one shows, and what it returns or raises.

Every rank answered: with its value, or with the error its call raised. Values come back as a
list in rank order; errors are raised as a launch raises them (``RankFailedError``: the first
rank's traceback, the others in one line each, the ranks a released collective failed marked as
consequences), and an interrupted call raises ``LaunchInterrupted``, saying where the ranks
stopped. Either way the ranks, their process group and what they hold stay, unless a rank's GPU
no longer works after its error: then the pool ends, saying so (``end_pool``), and the next call
starts fresh ranks.

Example::

    results = finish_call(call, settling, shown, elapsed, only=None, steps=launch.steps, pool=warm_ranks)
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any, Callable

from nblaunch.events import Display, LaunchFinished, RankFinished, RankStarted, RankState
from nblaunch.launch.errors import LaunchCancelledError, LaunchInterrupted, RankFailedError
from nblaunch.step_split import LaunchSteps
from nblaunch.worker.warm import failed_frames

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


def finish_call(call: Any, settling: Any, shown: Display, elapsed: float, only: tuple[int, ...] | None,
                steps: LaunchSteps, pool: Any) -> list[Any]:
    """Show the call's end in ``shown``; return its values, or raise its error, which the
    debugger can ask about the failed ranks' live frames (``live_frames``). A rank whose GPU
    no longer works after its error (``RankFailure.device_lost``) ends the ``pool``: every
    later cell would fail on it, and a process group cannot go on without one of its ranks.
    ``steps``, the call's step split, ends every display with its summary."""
    ranks = [r for r in range(call.num_ranks) if only is None or r in only]
    steps = steps if steps.ranks or steps.notes else None  # the summary every display ends with
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
                                      summary=f"interrupted after {elapsed:.2f} s: {where}; {_KEPT}",
                                      steps=steps))
        raise error
    if failures:
        in_time_order = sorted(failures.values(), key=lambda f: f.failed_at or 0.0)
        finished = [r for r in ranks if r in call.results]
        error = RankFailedError.blaming(in_time_order, {}, [], finished)
        root = error.root_cause
        after = _KEPT
        lost = next(((r, f) for r, f in sorted(failures.items()) if f.device_lost), None)
        if lost is not None:
            after = (f"rank {lost[0]}'s GPU no longer works in its process ({lost[1].device_lost}), so the warm ranks "
                     "were ended (their process group cannot go on without it): what they held is gone, and the "
                     "next cell starts fresh ones")
            pool.end_with(f"rank {lost[0]}'s GPU no longer worked: {lost[1].device_lost}")
        else:
            error.live_frames = _live_frames(weakref.ref(pool))  # post_mortem asks them
        shown.on_event(LaunchFinished(RankState.FAILED, elapsed, error=error, root_cause_rank=root.rank,
                                      summary=f"rank {root.rank} failed after {elapsed:.2f} s: {root.reason}; {after}",
                                      steps=steps))
        raise error
    results = [call.results[r] for r in ranks]
    shown.on_event(LaunchFinished(RankState.DONE, elapsed, results=results,
                                  summary=f"{_ranks_done(ranks, call.num_ranks)} done in {elapsed:.3f} s (warm)",
                                  steps=steps))
    return results


def _live_frames(pool_ref: Callable[[], Any]) -> Callable[[int, int, str, str], str | None]:
    """Ask rank ``rank`` to evaluate ``source`` in frame ``index`` of its failed call
    (``worker/warm/failed_frames``); None where it cannot (the pool ended, a call ran since)."""

    def ask(rank: int, index: int, kind: str, source: str) -> str | None:
        pool = pool_ref()
        if pool is None or not pool.alive:
            return None
        try:
            return pool.run(failed_frames.evaluate, kind, source, index, ranks=[rank], display="none")[0]
        except Exception:  # noqa: BLE001  the debugger reads what the rank sent instead
            return None

    return ask


def raise_how_the_pool_ended(launch: Any, settling: Any, num_ranks: int, close_s: float) -> None:
    """The pool ended during the call (a rank died, a timeout, an interrupt that could not stop
    the ranks gently): raise what ended it, saying that what the ranks held is gone."""
    try:
        launch.result(timeout=close_s)  # raises the pool's error
    except LaunchCancelledError as error:
        if settling.interrupted:  # the user's interrupt ended them: a KeyboardInterrupt
            raise LaunchInterrupted(f"{error}; the next cell starts fresh ones") from None
        raise
    except RankFailedError:
        print(f"nblaunch: the warm ranks ended with this failure: what they held is gone; the next cell starts "
              f"{num_ranks} fresh ones", file=sys.stderr)
        raise
    raise RuntimeError("the warm ranks ended during the call")  # not reached: they ended for a reason


def _is_interrupt(failure: Any) -> bool:
    return isinstance(failure.exception, KeyboardInterrupt) or failure.type_name.endswith("CellInterrupted")


def _ranks_done(ranks: list[int], num_ranks: int) -> str:
    if len(ranks) == num_ranks:
        return f"all {num_ranks} ranks"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {num_ranks}"
