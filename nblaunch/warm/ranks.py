"""``WarmRanks``: start the ranks once, then run functions on them in milliseconds.

The pool is a launch like any other (same plan, lifelines, logs, stacks, teardown); the
function its ranks run is a loop that serves calls (``nblaunch.worker.calls``). A call goes to
every rank as one frame on its control pipe and comes back as one ``CALL_RESULT`` per rank.
A call's end keeps the processes, their group and what the functions stored in them, whether it
returned, raised (a cell's error) or was interrupted (``settling`` brings every rank back first). Ranks that can no longer run together (one died, or
stays stuck), and a timeout, end the pool as a launch ends (stacks, every rank stopped and
reaped); the next call starts a fresh pool and says so in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import sys
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from nblaunch import wire
from nblaunch.display import make_display
from nblaunch.events import Display, RankState
from nblaunch.clusters import cluster_class
from nblaunch.launch import ipython_errors
from nblaunch.launch.errors import LaunchCancelledError, LaunchConfigError, LaunchTimeoutError
from nblaunch.launch.handle import Launch
from nblaunch.launch.planning import pickling
from nblaunch.launch.planning.request import STALL_AFTER_S, LaunchRequest
from nblaunch.launch.processes import fdtable
from nblaunch.launch.processes.packing import Payload
from nblaunch.step_split import LaunchSteps, remember
from nblaunch.warm.call_outcome import finish_call, raise_how_the_pool_ended, show_start
from nblaunch.warm.call_router import CALL_DASHBOARD_AFTER_S, CallRouter, CallTimedOut
from nblaunch.warm.detached_pool import DetachedWarmRanks
from nblaunch.warm.pool_job import PoolJob
from nblaunch.warm.pool_request import checked_ranks, pool_cluster, pool_request
from nblaunch.warm.settling import Presses, Settling
from nblaunch.worker.warm.group import reform_group

_CLOSE_S = 30.0  # backstop for ranks to leave after CLOSE; they take milliseconds
_REFORM_S = 60.0  # backstop for re-forming the group: gloo connects in milliseconds


class WarmRanks:
    """Ranks that stay up between calls, keeping their process group and what they hold.

    ``detach=True`` keeps them under a supervisor of their own, outside the kernel: a kernel
    restart leaves them (and what they hold) up, and ``WarmRanks.attach()`` in the next kernel
    runs on them again (see :mod:`nblaunch.warm.detached_pool`).

    Args:
        num_processes, mixed_precision, use_port, start_method, cpu: as for ``notebook_launcher``.
        num_nodes, cluster: ``cluster="ray"`` keeps ``num_nodes`` nodes of ``num_processes``
            ranks each up on the Ray cluster (as ``notebook_launcher(..., cluster="ray")``
            places them); calls then take a few Ray round trips instead of a launch.
            ``cluster="slurm"`` keeps them on the nodes of this kernel's Slurm allocation
            (every node unless ``num_nodes`` narrows), as ``notebook_launcher`` places them.
        display: how each call shows itself ("auto", "widget", "text", "none"); ``run`` can
            choose per call.
        stall_after: seconds a call may go without progress before its cell names the ranks that
            hold the others up (as for ``notebook_launcher``); None never looks.

    Example::

        >>> ranks = WarmRanks(num_processes=2, display="none")
        >>> ranks.run(lambda: __import__("os").environ["RANK"])
        ['0', '1']
        >>> ranks.close()
    """

    def __new__(cls, num_processes: int | None = None, mixed_precision: str = "no", *,
                use_port: int | str | None = None, start_method: str | None = None,
                display: str | Display = "auto", num_nodes: int | None = None, cluster: str | None = None,
                cpu: bool = False, detach: bool = False, stall_after: float | None = STALL_AFTER_S) -> Any:
        if not isinstance(detach, bool):
            raise LaunchConfigError(f"detach must be True or False, got {detach!r}")
        if not detach:
            return super().__new__(cls)
        request = pool_request(num_processes, mixed_precision, use_port, start_method, num_nodes, cluster, cpu,
                                stall_after)
        if not cluster_class(request).detaches_warm_ranks:
            raise LaunchConfigError(f"detach=True keeps warm ranks on this machine: leave cluster={cluster!r} out "
                                    "(detached warm ranks on a cluster are not supported yet)")
        num_processes = pool_cluster(request).plan.num_processes  # bad input is refused here; nothing starts
        return DetachedWarmRanks.start(PoolJob(request, WarmRanks.from_request), num_processes, display)

    @classmethod
    def attach(cls, launch_id: str | None = None, display: str | Display = "auto") -> DetachedWarmRanks:
        """This user's detached warm ranks (the latest, or ``launch_id``, a unique start of its
        id), from any kernel: the same ranks, their namespaces and what they hold."""
        return DetachedWarmRanks.latest(launch_id, display)

    def __init__(self, num_processes: int | None = None, mixed_precision: str = "no", *,
                 use_port: int | str | None = None, start_method: str | None = None,
                 display: str | Display = "auto", num_nodes: int | None = None, cluster: str | None = None,
                 cpu: bool = False, detach: bool = False, stall_after: float | None = STALL_AFTER_S) -> None:
        self._take(pool_request(num_processes, mixed_precision, use_port, start_method, num_nodes, cluster, cpu,
                                 stall_after), display)

    @classmethod
    def from_request(cls, request: LaunchRequest, display: str | Display = "none") -> "WarmRanks":
        """Warm ranks for a pool's ``request``, as ``WarmRanks(...)`` made it (a detached pool's
        supervisor makes its pool so)."""
        pool = object.__new__(cls)
        pool._take(request, display)
        return pool

    def _take(self, request: LaunchRequest, display: str | Display) -> None:
        self.request = request
        self._display = display
        # Bad input is refused here, before anything starts; each start of the ranks plans again
        # (a fresh port), with the display that routes each call's events to its cell.
        self._cluster = pool_cluster(request)
        self._launch: Launch | None = None
        self._router: CallRouter | None = None
        self._ids = itertools.count(1)
        self._generations = itertools.count(1)  # of the group, re-formed after a release
        self._one_call = threading.Lock()
        self._ended_with: str | None = None  # why the last pool ended, said once by the next call
        self._closed = False
        self._steps = LaunchSteps()  # the last call's (none yet)
        _pools.add(self)

    # -- the pool ------------------------------------------------------------------------

    @property
    def num_processes(self) -> int:
        """Ranks per node (all of them on one machine)."""
        return self._cluster.plan.num_processes

    @property
    def _num_ranks(self) -> int:
        return self._cluster.plan.shown_ranks

    @property
    def alive(self) -> bool:
        """True while the ranks are up (False before the first call and after a failure)."""
        return self._launch is not None and not self._launch.done()

    def run(self, function: Callable[..., Any], *args: Any, timeout: float | None = None,
            display: str | Display | None = None, ranks: Sequence[int] | None = None) -> list[Any]:
        """Run ``function(*args)`` on every rank; return ``[result of rank 0, rank 1, ...]``.

        ``ranks`` runs it on those ranks only (their results, in that order); collectives are
        then refused in it, since the other ranks would never join them.

        An error is the call's, as a notebook cell's is: it raises what a launch raises
        (RankFailedError: the first failing rank's traceback, the others in a line each), and
        the ranks and everything they hold stay. So does an interrupt (LaunchInterrupted): ranks
        that train stop together at a step boundary; others where they are. Ranks that can no
        longer run together (one died, lost its GPU, or stays stuck in a collective) and a
        timeout end the pool, saying why; the next call starts fresh ones."""
        __tracebackhide__ = True
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
            raise LaunchConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if self._closed:
            raise LaunchConfigError("these warm ranks were closed; make a new WarmRanks to run more")
        only = self.checked_ranks(ranks)
        ipython_errors.install()
        with self._one_call:
            try:
                return self._call(function, args, timeout, self._display if display is None else display, only)
            except BaseException as error:
                raise error.with_traceback(None)

    def checked_ranks(self, ranks: Sequence[int] | None) -> tuple[int, ...] | None:
        """``ranks`` as a call takes them, or LaunchConfigError naming the valid ones."""
        return checked_ranks(ranks, self._num_ranks)

    @property
    def steps(self) -> LaunchSteps:
        """The last call's training steps, split into their parts, as ``Launch.steps`` has a
        launch's: ``ranks.steps[1].data``, ``ranks.steps.straggler``, ``print(ranks.steps)``."""
        return self._steps

    def close(self) -> None:
        """Let the ranks leave (their process group goes with them). Safe to call twice."""
        self._closed = True
        launch, self._launch = self._launch, None
        if launch is None or launch.done():
            return
        launch.send(wire.CLOSE)
        try:
            launch.result(timeout=_CLOSE_S)
        except BaseException:
            launch.cancel()

    def __enter__(self) -> "WarmRanks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "up" if self.alive else "closed" if self._closed else "not started" if self._launch is None else "ended"
        n = self._num_ranks
        return f"<WarmRanks: {n} process{'es' if n != 1 else ''}, {state}>"

    # -- one call ------------------------------------------------------------------------

    def _call(self, function: Callable, args: tuple, timeout: float | None, display: str | Display,
              only: tuple[int, ...] | None) -> list[Any]:
        call_id = next(self._ids)
        packed = self._package_call(call_id, function, args, only)  # refused here, before anything is sent
        presses = Presses()  # interrupts during the call are counted, not raised
        try:
            launch, router = self._ensure_started()
            call = router.begin(call_id, self._num_ranks)
            # On the cell's thread: it shows in this cell (a quick call's dashboard is never made).
            shown = make_display(display, self._num_ranks, build_after_s=CALL_DASHBOARD_AFTER_S)
            settling = Settling(launch, call)
            try:
                started = launch.reset_clock()
                show_start(shown, router, function)
                self._pump(call, settling, shown, launch, None if timeout is None else started + timeout, timeout,
                           packed, presses)
                if call.ended is not None:
                    self._ended_with = call.ended.summary
                    raise_how_the_pool_ended(launch, settling, self._num_ranks, _CLOSE_S)
            finally:
                router.end(call)
                steps = self._keep_steps(function, launch)
            # Interrupted: the cell ends with that; a press after the ranks came back (the stop
            # button pressed twice) must not cut its report or the group's re-forming short.
            try:
                return finish_call(call, settling, shown, time.monotonic() - started, only, steps, pool=self)
            finally:
                shown.close()
                if settling.released and self._ended_with is None:  # each rank re-forms its group where it released it
                    self._reform_group(launch)
        finally:
            presses.restore()
            fdtable.close(packed.fds)  # the ranks hold their own copies of the descriptors

    def _pump(self, call: Any, settling: Settling, shown: Display, launch: Launch, deadline: float | None,
              timeout: float | None, packed: Payload, presses: Presses) -> None:
        """Send the call, then show its events until every rank answered. A failure or an
        interrupt brings the ranks back to their call loop (``settling``); ranks that do not come
        back, and a timeout, end the pool."""
        presses.counting()  # from here an interrupt is a count the loop reads, never raised mid-way
        launch.send(wire.CALL, packed.data, packed)
        fdtable.close(packed.fds)  # sent: the ranks have their own; less to hold during the call
        ended_because = ""
        while not call.over:
            try:
                for event in call.events(None if ended_because else deadline, tick=Settling.TICK_S):
                    if event is not None:
                        shown.on_event(event)
                    if ended_because:  # the pool is ending: more presses change nothing
                        presses.take()
                        continue
                    for _ in range(presses.take()):
                        ended_because = ended_because or settling.interrupt()
                    ended_because = ended_because or settling.tick()
                    if ended_because:
                        launch.cancel(LaunchCancelledError(f"the warm ranks were ended: {ended_because}"))
            except CallTimedOut:
                ended_because = "timeout"
                launch.cancel(LaunchTimeoutError(timeout or 0.0, {}))
        if presses.take():  # it came as the ranks finished: the cell is interrupted all the same
            settling.interrupted = True

    def _keep_steps(self, function: Callable, launch: Launch) -> LaunchSteps:
        """The call's steps (the launch's clock was reset for it), kept for ``steps`` and
        ``nblaunch.last_steps()`` where the call was the user's: not the debugger's, nor ours."""
        steps = launch.steps
        if function is not reform_group and not getattr(function, "keeps_failed_frames", False):
            self._steps = steps
            remember(steps)
        return steps

    def end_with(self, why: str) -> None:
        """End the ranks now; the next call says ``why`` once, and starts fresh ones."""
        self._ended_with = why  # read by _ensure_started
        self._launch.cancel()
        with contextlib.suppress(BaseException):
            self._launch.result(timeout=_CLOSE_S)  # over before the next call looks

    def _reform_group(self, launch: Launch) -> None:
        """After a release: a fresh backend for the pool's group on every rank, or the pool ends."""
        try:
            self._call(reform_group, (next(self._generations),), _REFORM_S, "none", None)
        except BaseException as error:  # noqa: BLE001  said, and the pool ended: the next call starts afresh
            print(f"nblaunch: the warm ranks' process group could not be re-formed after the failed call "
                  f"({error}); they were stopped: the next call starts fresh ones", file=sys.stderr)
            launch.cancel()

    def _ensure_started(self) -> tuple[Launch, CallRouter]:
        if self.alive:
            assert self._launch is not None and self._router is not None
            return self._launch, self._router
        if self._launch is not None and self._ended_with is None:
            self._raise_how_the_ranks_ended_between_calls()
        if self._ended_with is not None:
            print(f"nblaunch: the warm ranks had ended ({self._ended_with}); starting {self._num_ranks} fresh "
                  f"one{'s' * (self._num_ranks != 1)}: what the old ones held is gone", file=sys.stderr)
            self._ended_with = None
        router = CallRouter(self._num_ranks)
        self._cluster = pool_cluster(dataclasses.replace(self.request, display=router))
        launch = Launch(self._cluster)
        launch.start(stop_at_exit=False)  # warm ranks are closed quietly at exit, see _close_all
        self._launch, self._router = launch, router
        try:
            router.ranks_up.wait()
        except BaseException:  # interrupted while the ranks start: they must not linger
            launch.cancel()
            raise
        return launch, router

    def _raise_how_the_ranks_ended_between_calls(self) -> None:
        """A rank died while no call ran (killed, out of memory, a thread of it failed): that
        failure is what this call raises, so it is never lost; the next call starts afresh."""
        assert self._launch is not None and self._router is not None
        ended = self._router.ended
        self._ended_with = ended.summary if ended is not None else "they ended between calls"
        if ended is not None and ended.state != RankState.DONE:
            print("nblaunch: the warm ranks ended while no call ran, so this call did not run; "
                  "the next one starts fresh ranks", file=sys.stderr)
        self._launch.result(timeout=_CLOSE_S)  # raises the pool's error, if it had one

    def _package_call(self, call_id: int, function: Callable, args: tuple, only: tuple[int, ...] | None) -> Payload:
        """The call for the ranks (big tensors and arrays in memfds on one machine, as for a
        spawn launch)."""
        if not callable(function):
            raise LaunchConfigError(f"run() needs a function to call, got {type(function).__name__}")
        try:
            return self._cluster.package((call_id, function, args, only))
        except Exception:
            pickling.check_picklable(function, args)  # names the culprit
            raise


_pools: "weakref.WeakSet[WarmRanks]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_pools):
        try:
            pool.close()
        except BaseException:
            pass
