"""The :class:`Launch`: one launch from start to end, and the handle ``block=False`` returns.

A non-blocking launch runs in a thread of its own. If the interpreter exits while one still
runs (a script's last line, a kernel shut down), it is stopped as ``cancel()`` would: every
rank's stack goes to its log, every rank is stopped, the logs are kept and the launch's record
removed, and one line says so. (Waiting instead could hold a kernel's shutdown for hours.)
"""

from __future__ import annotations

import atexit
import contextvars
import dataclasses
import functools
import os
import sys
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from typing import Any

from nblaunch.display import Fanout, make_display
from nblaunch.events import (Event, LaunchFinished, LaunchRestarting, LaunchStarted, RankFinished, RankStarted,
                             RankState, Stacks, StepTimes)
from nblaunch.launch.errors import LaunchCancelledError, LaunchInterrupted, LaunchTimeoutError, RankFailedError
from nblaunch.launch.logfiles import LogFiles, new_log_dir
from nblaunch.launch.planning import ports
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes.packing import Payload
from nblaunch.launch.cluster_interface import Cluster, RankWatcher
from nblaunch.step_split import LaunchSteps, StepBook, remember

_STOP_AT_EXIT_S = 30.0  # backstop: stopping takes well under a second


class Launch:
    """A launch in progress or finished; ``notebook_launcher(..., block=False)`` returns one.

    Made from a cluster (``launch/cluster_interface``), which holds the checked request and its plan: the
    function, its arguments, the timeout and the display are the request's.

    Example::

        launch = notebook_launcher(train, num_processes=2, block=False)
        launch.status          # "running"
        launch.logs(1)[-200:]  # rank 1's log so far
        launch.cancel()        # or: results = launch.result()
    """

    def __init__(self, cluster: Cluster):
        self.launch_id = uuid.uuid4().hex
        # On the caller's thread: a cluster may import for the ranks or ask its nodes first,
        # and says what it did in the plan's words.
        self._cluster = cluster
        self._cluster.prepare(self.launch_id)
        self.plan = plan = cluster.plan
        self._timeout = plan.request.timeout
        self._future: Future = Future()
        self._lock = threading.Lock()
        self._supervisor: RankWatcher | None = None  # the current attempt's
        self._cancel_requested = False
        self._cancel_as: BaseException | None = None
        self._clock_start = time.monotonic()  # elapsed times count from here (see reset_clock)
        self._rank_states: dict[int, RankState] = {}
        self._stacks_answered = threading.Condition()
        self._asked_stacks: dict[int, str] = {}
        self._steps = StepBook(plan.shown_ranks)
        self._status = "starting"
        self._made_at = time.strftime("%H:%M:%S")
        self._pid = os.getpid()  # a fork of this process does not own the launch
        self.log_dir = new_log_dir(cluster.shared_log_root())
        self._logs = LogFiles(self.log_dir, plan.shown_ranks)
        # Made here, on the caller's thread: a widget shows itself in the launching cell.
        self._display = make_display(plan.request.display, plan.shown_ranks)
        self._sink = Fanout(self._logs, self._display)

    # ------------------------------------------------------------------ the handle
    @property
    def status(self) -> str:
        """starting, running, done, failed, timed out, cancelled or interrupted."""
        return self._status

    @property
    def ranks(self) -> dict[int, RankState]:
        """Each rank's state."""
        return dict(self._rank_states)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the launch (at most ``timeout`` seconds) and return each rank's result, or
        raise what the launch raised (RankFailedError, LaunchTimeoutError, ...)."""
        __tracebackhide__ = True
        try:
            return self._future.result(timeout)
        except BaseException as error:
            if self._future.done() and error is self._future.exception():
                raise error.with_traceback(None)  # the launch thread's frames say nothing to the user
            raise

    def cancel(self, error: BaseException | None = None) -> bool:
        """Show every rank's stack, stop every rank; ``result()`` then raises ``error``, or
        LaunchCancelledError when it is None (a LaunchTimeoutError gets the stacks). False if the
        launch had already finished. Safe from any thread."""
        with self._lock:
            if self._future.done():
                return False
            self._cancel_requested = True
            self._cancel_as = error
            if self._supervisor is not None:
                self._supervisor.cancel(error)
        return True

    def send(self, kind: bytes, body: bytes = b"", shared: Payload | None = None) -> bool:
        """One frame (``nblaunch.wire``) to every live rank: a warm pool's calls, with the
        memfds ``shared`` holds. False when no rank runs."""
        with self._lock:
            if self._future.done() or self._supervisor is None:
                return False
            self._supervisor.send_to_ranks(kind, body, shared)
            return True

    def stacks(self, timeout: float = 5.0) -> dict[int, str]:
        """Where every running rank is now, ``{rank: stack}``, without stopping the launch.

        Each stack is every thread's, from the user's code on; they also appear in the dashboard
        and in each rank's log. A rank that has not answered within ``timeout`` seconds (its
        Python threads blocked, say by C code holding the GIL) is left out. ``{}`` once the
        launch has ended.

        Example::

            launch = notebook_launcher(train, num_processes=2, block=False)
            print(launch.stacks()[1])  # where rank 1 is
        """
        with self._stacks_answered:
            self._asked_stacks = {}
            if not self.request_stacks():
                return {}

            def answered() -> bool:
                running = [r for r, state in self._rank_states.items() if state is RankState.RUNNING]
                return self._future.done() or all(r in self._asked_stacks for r in running)

            self._stacks_answered.wait_for(answered, timeout)
            return dict(self._asked_stacks)

    def request_stacks(self) -> bool:
        """Ask every live rank for its stack and do not wait (the dashboard's Stacks button):
        the answers come as ``Stacks`` events. False when nothing runs."""
        with self._lock:
            if self._future.done() or self._supervisor is None:
                return False
            self._supervisor.request_stacks()
            return True

    def logs(self, rank: int) -> str:
        """Rank ``rank``'s whole log so far (from disk)."""
        self._logs.flush()
        with open(self._logs.path(rank), encoding="utf-8", errors="replace") as log:
            return log.read()

    def __repr__(self) -> str:
        # A saved cell keeps this text for good: a state that can still change says it was a moment's.
        head = f"<Launch {self.plan.request.function_name} on {self.plan.shown_ranks} processes, made at {self._made_at}"
        status = self.status
        if status in ("starting", "running"):
            return f"{head}: {status} when shown; .status says now, .result() waits for the end>"
        return f"{head}: {status}>"

    def reset_clock(self) -> float:
        """Count the elapsed times shown, and the steps, from now on (a warm pool: from each
        call); returns that moment (``time.monotonic()``)."""
        self._steps.clear()
        self._clock_start = time.monotonic()
        return self._clock_start

    # ------------------------------------------------------------------ running it
    def start(self, *, stop_at_exit: bool = True) -> None:
        """Run the launch in a thread of its own and return at once (``block=False``).

        ``stop_at_exit``: if the interpreter exits while the launch runs, stop it as ``cancel()``
        would, saying so in one line (owners that close their launch themselves pass False).
        """
        set_stop_handler = getattr(self._display, "set_stop_handler", None)
        if set_stop_handler is not None:  # the widget's Stop button: it can only work when not blocking
            set_stop_handler(self.cancel, self.request_stacks)
        # The thread starts spawned ranks and lives until they are reaped: PR_SET_PDEATHSIG fires
        # when the thread that started them exits (forked ranks come from the forking thread).
        # A display that prints (text) runs in a copy of the caller's context: ipykernel 7
        # keeps the launching cell there, so late lines land in that cell.
        # Widgets update through comm messages, which find their widget from any thread; tagging
        # them with a finished cell would make nbclient/papermill drop them.
        run = self._run_quietly
        if getattr(self._display, "prints_to_cell", False):
            run = functools.partial(contextvars.copy_context().run, self._run_quietly)
        thread = threading.Thread(target=run, name=f"nblaunch-{self.plan.request.function_name}", daemon=True)
        if stop_at_exit:
            _unfinished.add(self)
        thread.start()

    def _run_quietly(self) -> None:
        try:
            self._run()
        except BaseException:
            pass  # kept in the future; result() raises it

    @property
    def steps(self) -> LaunchSteps:
        """Every rank's training steps split into their parts, so far (see ``nblaunch.step_split``).

        Example::

            launch.steps[1].data       # rank 1's typical wait for data per step, in seconds
            launch.steps.straggler     # 1: the rank that holds the others up (or None)
            print(launch.steps)        # the summary: each rank's split, what the ranks buy, what to do
        """
        return self._steps.report()

    def _emit(self, event: Event) -> None:
        if isinstance(event, StepTimes):
            self._steps.add(event.rank, event.steps)
            if event.note:
                self._steps.note(event.note)
        elif isinstance(event, LaunchRestarting):
            self._steps.clear()  # the steps of the new start are counted afresh
        elif isinstance(event, LaunchFinished) and event.steps is None:
            report = self._steps.report()
            if not getattr(self._display, "steps_per_call", False):  # a warm pool's are its calls'
                remember(report)  # for nblaunch.last_steps(): a blocking launch returns only its results
            if report.ranks or report.notes:
                event = dataclasses.replace(event, steps=report)  # every display ends with the same summary
        if isinstance(event, RankStarted):
            self._rank_states[event.rank] = RankState.RUNNING
            self._status = "running"
        elif isinstance(event, RankFinished):
            self._rank_states[event.rank] = event.state
        self._sink.on_event(event)
        if isinstance(event, (Stacks, RankFinished)):
            with self._stacks_answered:
                if isinstance(event, Stacks) and event.why == "asked":
                    self._asked_stacks[event.rank] = event.text
                self._stacks_answered.notify_all()

    def run(self) -> list[Any]:
        """Run the launch to its end here and return each rank's result, or raise what it
        raised. Call it, or ``start``, once."""
        return self._run()

    def _run(self) -> list[Any]:
        plan = self.plan
        started = self._clock_start = time.monotonic()
        self._emit(LaunchStarted(
            function_name=plan.request.function_name, num_processes=plan.shown_ranks, world_size=plan.world_size,
            node_rank=plan.node_rank, start_method=plan.start_method, start_reason=plan.start_reason,
            master_addr=plan.master_addr, master_port=plan.master_port, devices=plan.devices,
            log_dir=self.log_dir, meeting_point=plan.meeting_point,
        ))
        outcome: Any = None
        try:
            while True:
                try:
                    results = self._attempt(plan, started)
                    break
                except RankFailedError as error:
                    if plan.restart >= plan.request.max_restarts or self._cancel_requested:
                        raise
                    plan = _next_start(plan)
                    root = error.root_cause
                    self._emit(LaunchRestarting(restart=plan.restart, max_restarts=plan.request.max_restarts,
                                                failed_rank=root.rank, reason=root.reason.splitlines()[0]))
            elapsed = time.monotonic() - self._clock_start
            self._status = "done"
            restarted = f" after {plan.restart} restart{'s' if plan.restart != 1 else ''}" if plan.restart else ""
            self._emit(
                LaunchFinished(
                    state=RankState.DONE, elapsed_s=elapsed, results=results,
                    summary=f"{_all_ranks(plan.shown_ranks)} done in {elapsed:.2f} s{restarted}",
                )
            )
            outcome = results
            return results
        except BaseException as error:
            self._status, finished = _ending(error, time.monotonic() - self._clock_start, plan)
            self._emit(finished)
            outcome = error
            raise
        finally:
            self._sink.close()
            # Last: whoever waits on result() finds the display closed and the logs complete.
            if isinstance(outcome, BaseException):
                self._future.set_exception(outcome)
            else:
                self._future.set_result(outcome)

    def _attempt(self, plan: LaunchPlan, started: float) -> list[Any]:
        """Start every rank of ``plan``, supervise them to the end, leave nothing behind."""
        timeout = None
        if self._timeout is not None:  # one budget for the launch, restarts included
            timeout = self._timeout - (time.monotonic() - started)
            if timeout <= 0:
                raise LaunchTimeoutError(self._timeout, {})
        try:
            with self._cluster.attempt(plan, self._emit, timeout, self.log_dir) as watcher:
                with self._lock:
                    self._supervisor = watcher
                    if self._cancel_requested:
                        watcher.cancel(self._cancel_as)
                try:
                    return watcher.run()
                except LaunchTimeoutError as error:
                    figure = self._timeout if self._timeout is not None else error.timeout  # the user's figure
                    again = LaunchTimeoutError(figure, error.stacks)
                    again.kept = error.kept
                    raise again from None
        except KeyboardInterrupt as interrupt:
            if isinstance(interrupt, LaunchInterrupted):
                raise
            # It came while the ranks were starting, before anyone could ask them for stacks: the
            # cluster's attempt has stopped what it had started. Still the launch's interrupt.
            raise LaunchInterrupted("interrupted while the ranks were starting; every rank was stopped") from None


def _next_start(plan: LaunchPlan) -> LaunchPlan:
    """The plan of the next start after a failure: a fresh port unless one was pinned."""
    port = plan.master_port if plan.port_pinned else ports.choose_port(plan.master_addr, None, hosted_here=True)
    return dataclasses.replace(plan, restart=plan.restart + 1, master_port=port)


def _ending(error: BaseException, elapsed: float, plan: LaunchPlan) -> tuple[str, LaunchFinished]:
    """How a launch that raised ``error`` ended: its ``Launch.status`` and its last event."""
    if isinstance(error, RankFailedError):
        root = error.root_cause
        restarts = f" (restarted {plan.restart} of {plan.request.max_restarts} times)" if plan.request.max_restarts else ""
        summary = f"rank {root.rank} failed after {elapsed:.2f} s{restarts}: {root.reason}"
        return "failed", LaunchFinished(
            RankState.FAILED, elapsed, error=error, root_cause_rank=root.rank, summary=summary
        )
    if isinstance(error, LaunchTimeoutError):
        status = "timed out"
        summary = f"timed out after {elapsed:.2f} s (timeout={error.timeout:g}); {_stopped(error)}"
    elif isinstance(error, KeyboardInterrupt):
        status, summary = "interrupted", f"interrupted after {elapsed:.2f} s; {_stopped(error)}"
    elif isinstance(error, LaunchCancelledError):
        status, summary = "cancelled", f"cancelled after {elapsed:.2f} s; {_stopped(error)}"
    else:
        status, summary = "failed", f"the launch failed after {elapsed:.2f} s: {error!r}"
    return status, LaunchFinished(RankState.STOPPED, elapsed, error=error, summary=summary)


def _stopped(error: BaseException) -> str:
    """How the ranks were stopped: at a common step with their state saved (where), or where they were."""
    kept = getattr(error, "kept", None)
    return str(kept) if kept is not None else "every rank was stopped"


_unfinished: "weakref.WeakSet[Launch]" = weakref.WeakSet()  # non-blocking launches not yet done


@atexit.register
def _stop_unfinished_launches() -> None:
    # Only in the process that started them (a fork of the kernel that exits normally inherits
    # this list), all stopped at once: Jupyter kills a kernel a few seconds into its shutdown.
    running = [launch for launch in list(_unfinished) if launch._pid == os.getpid() and not launch.done()]
    for launch in running:
        try:
            print(
                f"nblaunch: the interpreter is exiting while the launch of {launch.plan.request.function_name} "
                f"(block=False) still runs: stopping it. Its logs: {launch.log_dir}. To wait for it "
                "instead, call launch.result() before the end.",
                file=sys.stderr,
            )
        except Exception:
            pass  # a closed stream must not keep the launch running
        launch.cancel()
    deadline = time.monotonic() + _STOP_AT_EXIT_S
    for launch in running:
        try:
            launch.result(timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:
            pass


def _all_ranks(count: int) -> str:
    """``all 2 ranks``; ``rank 0`` for a launch of one."""
    return "rank 0" if count == 1 else f"all {count} ranks"
