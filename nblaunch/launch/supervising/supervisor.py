"""Watching the ranks of one launch until every one of them is reaped.

One thread, one ``select`` over every rank's pipes and exit notifications: output becomes
``Output`` events, frames become results, failures, metrics, progress and stacks. The first
failure, an interrupt or the timeout stops the launch the same way: ask every live rank for its
stack (briefly), SIGKILL every rank's process group (a rank blocked in a C++ collective cannot
run a Python handler; SIGKILL needs none), reap them all, close every pipe.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import selectors
import signal
import threading
import time
from typing import Any, Callable

from nblaunch import wire
from nblaunch.events import (Event, Metrics, Output, Progress, RankCompiling, RankDevice, RankFinished, RankStarted,
                             RankState, StepTimes)
from nblaunch.contract.failure import RankFailure
from nblaunch.launch.errors import (LaunchCancelledError, LaunchInterrupted, LaunchTimeoutError, RankFailedError,
                                    failure_from_exit)
from nblaunch.launch.processes.packing import Payload
from nblaunch.launch.supervising.gpu_usage import SAMPLE_EVERY_S, GpuSampler
from nblaunch.launch.processes.processes import WorkerProcess
from nblaunch.launch.supervising.interrupts import DeferredInterrupts, interrupts_wait
from nblaunch.launch.supervising.keeping_work import STACKS_ON_STOP_S, KeepingWork
from nblaunch.launch.supervising.oom_kills import OomKills
from nblaunch.launch.supervising import call_frames
from nblaunch.launch.supervising.stall import StallReports
from nblaunch.launch.supervising.stopping import StoppingRanks
from nblaunch.launch.supervising.watched_rank import WatchedRank

_READ_SIZE = 1 << 20
_POLL_WITHOUT_PIDFD_S = 0.05  # where pidfds are missing, exits are found by polling
_STACKS_ON_FAILURE_S = 0.05  # a healthy rank answers in milliseconds; the failure is what matters
_COALESCE_OUTPUT_S = 0.002  # after a small read of output, let more of it arrive before the next read
_COALESCE_BELOW = 64 * 1024
_DRAIN_MAX_READS = 64  # after a rank's exit, what its pipes held: at most 64 MiB each

_FD_STDOUT, _FD_STDERR, _FD_EVENTS, _FD_EXIT, _FD_WAKE = "stdout", "stderr", "events", "exit", "wake"  # see WatchedRank

class Supervisor(StoppingRanks, KeepingWork):
    """Runs one launch's ranks to the end and returns their results in rank order. ``keeps_work``:
    an interrupt, the timeout or a cancel first stops them at one step to save (``keeping_work``)."""

    def __init__(self, processes: list[WorkerProcess], emit: Callable[[Event], None], timeout: float | None,
                 gpus: GpuSampler | None = None, stall_after: float | None = None, first_rank: int = 0,
                 keeps_work: bool = False):
        self._emit = emit
        self._init_keeping_work(keeps_work)
        self._gpus = gpus  # each rank's GPU, sampled every SAMPLE_EVERY_S for its row
        self._next_sample = 0.0
        self._timeout = timeout
        self._processes = processes
        self._ranks = {pipes.rank: WatchedRank(pipes, process) for process in processes for pipes in process.ranks}
        self._selector = selectors.DefaultSelector()
        self._stacks: dict[int, str] = {}
        self._shown_failed: list[int] = []  # ranks in the order their failure was shown
        self._stopping = self._output_trickle = self._cancel_requested = self._stacks_requested = False
        self._cancel_as: BaseException | None = None  # what a cancel raises instead of LaunchCancelledError
        # Stopping as asked (interrupt, timeout, cancel): a rank that then loses a peer stopped a
        # moment earlier (here or on another node) was stopped, it did not fail.
        self._stopping_on_request = False
        self._stacks_why = "stop"  # what the next STACKS frames answer
        self._stalls = StallReports(stall_after, emit, first_rank)
        self._oom_kills = OomKills()  # a SIGKILL is blamed on the out-of-memory killer only if these rise
        self._call_sent = False  # a warm pool's call went out: the stall clock starts again
        self._wake_lock = threading.Lock()  # cancel() from any thread writes to wake the select loop
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, (None, _FD_WAKE))
        for rank in self._ranks.values():
            p = rank.pipes
            for fd, kind in ((p.stdout_fd, _FD_STDOUT), (p.stderr_fd, _FD_STDERR), (p.event_fd, _FD_EVENTS)):
                self._selector.register(fd, selectors.EVENT_READ, (rank, kind))
        for process in processes:
            if process.exit_fd is not None:
                self._selector.register(process.exit_fd, selectors.EVENT_READ, (process, _FD_EXIT))

    # ----------------------------------------------------------------------------- main loop
    def run(self) -> list[Any]:
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        deferred = DeferredInterrupts(self._wake_write)  # an interrupt lands at the loop's top, nothing half read
        try:
            # Said here, not when made: whoever waits for the ranks (a warm pool's first call) then
            # finds the launch holding this supervisor, ready to take frames for them. Inside the
            # try: a first display takes a while to draw these, and an interrupt while it does is
            # answered like any other (stacks, then stop).
            for rank in self._ranks.values():
                self._emit(RankStarted(rank=rank.number, pid=rank.process.pid))
            while self._live():
                deferred.raise_if_pressed()
                now = time.monotonic()
                if self._gpus is not None and now >= self._next_sample:
                    self._sample_gpus(now)
                sample_wait = None if self._gpus is None else self._next_sample - now
                if self._call_sent:
                    self._call_sent = False
                    self._stalls.heard()
                waits = [w for w in (None if deadline is None else deadline - now, self._stalls.wait(now), sample_wait)
                         if w is not None]
                self._pump(max(0.0, min(waits)) if waits else None)
                if self._output_trickle and not self._stopping:
                    # Chatty ranks: a wake-up per few lines costs the launcher more CPU than the
                    # ranks spend printing (on 2 cores it takes their CPU). Letting the pipes fill
                    # for a moment makes each read carry many lines; a 1 ms delay is invisible.
                    self._output_trickle = False
                    time.sleep(_COALESCE_OUTPUT_S)
                if not self._stopping:
                    self._stalls.report_when_answered(self._stacks, self._counts())
                if self._failures() and not self._stopping:
                    self._stop(_STACKS_ON_FAILURE_S, fallback=False)
                elif not self._stopping and self._stacks_requested:
                    self._ask_for_stacks("asked")
                elif not self._stopping and self._stalls.due():
                    busy = [r for r in self._live() if r.busy and r.failure is None]
                    self._stacks.clear()
                    self._ask_for_stacks("quiet", busy)
                    self._stalls.asked([r.number for r in busy])
                elif not self._stopping and (self._cancel_requested or (deadline is not None and time.monotonic() >= deadline)):
                    if not self._cancel_requested:
                        self._cancel_as = LaunchTimeoutError(self._timeout, {})
                    self._stopping_on_request = True
                    timed_out = isinstance(self._cancel_as, LaunchTimeoutError)
                    kept = self._keep_work_then_stop("timed out" if timed_out else "cancelled")
                    if self._finished_meanwhile():
                        break
                    if self._failures() and not timed_out:
                        continue  # a rank's own failure came in while cancelling: that is what is raised
                    error = self._cancel_as or LaunchCancelledError(
                        f"the launch was cancelled; {kept or 'every rank was stopped'}{self._not_kept}")
                    if timed_out:
                        error = LaunchTimeoutError(error.timeout, dict(self._stacks))
                    error.kept = kept
                    raise error
        except KeyboardInterrupt:
            with interrupts_wait():  # Ctrl-C twice must not cut the stop short
                kept = None
                if not self._stopping:
                    self._stopping_on_request = True
                    kept = self._keep_work_then_stop("interrupted")
                self._teardown()
            if not self._finished_meanwhile():
                error = LaunchInterrupted(f"{kept}" if kept else
                                          f"every rank was stopped; where each one was is shown above{self._not_kept}")
                error.kept = kept
                raise error from None
        finally:
            deferred.restore()
            self._teardown()
        failures = self._failures()
        if failures:
            raise self._failure_error(failures)
        return [self._ranks[r].result for r in sorted(self._ranks)]

    def _sample_gpus(self, now: float) -> None:
        self._next_sample = now + SAMPLE_EVERY_S
        live = {r.number: r.process.pid for r in self._live()}
        for usage in self._gpus.sample(live) if live else ():
            self._emit(usage)

    def cancel(self, raising: BaseException | None = None) -> None:
        """Stop the launch as an interrupt would (stacks, then stop), then raise ``raising``
        (LaunchCancelledError if None; a LaunchTimeoutError gets the stacks). Safe from any thread."""
        self._cancel_as = raising
        self._cancel_requested = True
        self._wake()

    def send_to_ranks(self, kind: bytes, body: bytes = b"", shared: Payload | None = None) -> None:
        """One frame to every live rank's control socket (a warm pool's calls, with the memfds
        ``shared`` holds). Safe from any thread."""
        for rank in self._live():
            if kind == wire.CALL:
                rank.busy = True
            rank.pipes.send(kind, body, shared)
        if kind == wire.CALL:
            self._call_sent = True
            self._wake()

    def request_stacks(self) -> None:
        """Ask every live rank where it is (answers: ``Stacks(why="asked")``). Any thread."""
        self._stacks_requested = True
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:  # never write to a closed (and maybe reused) descriptor
            if self._wake_write != -1:
                os.write(self._wake_write, b"x")

    def _ask_for_stacks(self, why: str, ranks: list[WatchedRank] | None = None) -> None:
        if why == "asked":
            self._stacks_requested = False
        self._stacks_why = why
        for rank in self._live() if ranks is None else ranks:
            if rank.failure is None:
                rank.pipes.request_stacks()

    @property
    def ended_cleanly(self) -> bool:  # every process stopped what it had started before it left
        return all(process.cleaned for process in self._processes)

    @property
    def stacks(self) -> dict[int, str]:
        return dict(self._stacks)

    @property
    def imported(self) -> list[str]:  # the installed libraries the ranks imported (wire.IMPORTED), once each
        return list(dict.fromkeys(name for r in sorted(self._ranks) for name in self._ranks[r].imported))

    def _counts(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Each rank's collectives, counted (``wire.COLLECTIVES``), by its number on this node."""
        return {r: rank.collectives for r, rank in self._ranks.items() if rank.collectives}

    def _live(self) -> list[WatchedRank]:
        return [r for r in self._ranks.values() if not r.finished]

    def _failures(self) -> list[WatchedRank]:
        return [r for r in self._ranks.values() if r.failure is not None]

    # ----------------------------------------------------------------------------- I/O
    def _live_processes(self) -> list[WorkerProcess]:
        return [p for p in self._processes if any(not self._ranks[r.rank].finished for r in p.ranks)]

    def _pump(self, wait: float | None) -> None:
        """Handle whatever is ready within ``wait`` seconds (None: until something happens)."""
        no_pidfd = any(p.exit_fd is None for p in self._live_processes())
        if no_pidfd:
            wait = _POLL_WITHOUT_PIDFD_S if wait is None else min(wait, _POLL_WITHOUT_PIDFD_S)
        registered = self._selector.get_map()
        for key, _ in self._selector.select(wait):
            if key.fd not in registered:
                continue  # an exit earlier in this batch drained and unregistered it
            owner, kind = key.data
            if kind == _FD_WAKE:
                os.read(self._wake_read, 4096)
            elif kind == _FD_EXIT:
                self._on_exit(owner)
            else:
                self._read(owner, kind, key.fd)
        if no_pidfd:
            for process in self._live_processes():
                if process.exit_fd is None and process.poll() is not None:
                    self._on_exit(process)

    def _read(self, rank: WatchedRank, kind: str, fd: int) -> bool:
        """Read one chunk; False at EOF or when nothing was there."""
        try:
            data = os.read(fd, _READ_SIZE)
        except BlockingIOError:
            return False
        if not data:
            self._selector.unregister(fd)
            if kind != _FD_EVENTS:
                self._emit_lines(rank, kind, rank.splitters[kind].flush(), None)
            return False
        if kind == _FD_EVENTS:
            for frame_kind, body in rank.frames.feed(data):
                self._on_frame(rank, frame_kind, body)
        else:
            lines, transient = rank.splitters[kind].feed(data)
            self._emit_lines(rank, kind, lines, transient)
            self._stalls.heard()
            if len(data) < _COALESCE_BELOW:
                self._output_trickle = True
        return True

    def _emit_lines(self, rank: WatchedRank, stream: str, lines: list[str], transient: str | None) -> None:
        r = rank.number
        if lines:
            rank.tail.extend(lines)
            self._emit(Output(rank=r, stream=stream, lines=tuple(lines)))
        if transient is not None:
            self._emit(Output(rank=r, stream=stream, lines=(transient,), transient=True))

    def _drain(self, rank: WatchedRank) -> None:
        """Read everything a dead rank left in its pipes (its result may be the last of it)."""
        self._read_what_is_there(rank, (_FD_EVENTS, _FD_STDOUT, _FD_STDERR))
        for fd in list(self._selector.get_map()):
            if self._selector.get_key(fd).data[0] is rank:
                self._selector.unregister(fd)
        for kind, splitter in rank.splitters.items():
            self._emit_lines(rank, kind, splitter.flush(), None)

    def _read_what_is_there(self, rank: WatchedRank, kinds: tuple[str, ...]) -> None:
        p = rank.pipes
        fds = {_FD_EVENTS: p.event_fd, _FD_STDOUT: p.stdout_fd, _FD_STDERR: p.stderr_fd}
        for kind in kinds:
            # Bounded: a helper the rank started may hold the pipe and never stop writing.
            for _ in range(_DRAIN_MAX_READS):
                if fds[kind] not in self._selector.get_map() or not self._read(rank, kind, fds[kind]):
                    break

    # ----------------------------------------------------------------------------- frames
    def _on_frame(self, rank: WatchedRank, kind: bytes, body: bytes) -> None:
        r = rank.number
        if self._on_stop_frame(r, kind, body):
            return
        if kind == wire.RESULT:
            try:
                rank.result = pickle.loads(body)
                rank.has_result = True
                rank.busy = False
                self._stalls.heard()
            except Exception as error:
                self._fail(rank, RankFailure(r, f"its return value could not be unpickled here: {error!r}"))
        elif kind == wire.ERROR:
            failure = dataclasses.replace(pickle.loads(body), rank=r)  # numbered by the pipe it came on
            if rank.failure is not None and not rank.failure.complete:
                rank.failure = failure  # the full report of the failure already known
            self._fail(rank, failure)
        elif kind == wire.METRICS:
            values, step = pickle.loads(body)
            self._emit(Metrics(rank=r, values=values, step=step))
            self._stalls.heard()
        elif kind == wire.PROGRESS:
            bar_id, n, total, desc, closed, auto = pickle.loads(body)
            self._emit(Progress(rank=r, bar_id=bar_id, n=n, total=total, desc=desc, closed=closed, auto=auto))
            self._stalls.heard()
        elif kind == wire.STEP_TIMES:
            steps, note = pickle.loads(body)
            self._emit(StepTimes(rank=r, steps=tuple(steps), note=note))
            self._stalls.heard()
        elif kind == wire.COLLECTIVES:
            rank.collectives = pickle.loads(body)
        elif kind == wire.STACKS:
            self._keep_stacks(r, body.decode("utf-8", "replace"))
        elif kind in call_frames.KINDS:
            if kind in call_frames.ANSWERS:
                # The rank flushed its output before sending this: the call's last lines come first.
                self._read_what_is_there(rank, (_FD_STDOUT, _FD_STDERR))
                rank.busy = False  # idle until the next call
                self._stalls.heard()
            event = call_frames.call_event(r, kind, body)
            self._fail(rank, event) if isinstance(event, RankFailure) else self._emit(event)
        elif kind == wire.MOVED:
            self._stalls.heard()
        elif kind == wire.DEVICE:
            device, precision = pickle.loads(body)
            self._emit(RankDevice(rank=r, device=device, precision=precision))
        elif kind == wire.COMPILING:
            compiling, seconds = pickle.loads(body)
            self._emit(RankCompiling(rank=r, compiling=compiling, seconds=seconds))
            self._stalls.heard()
        elif kind == wire.CLEANED:
            rank.process.cleaned = True
        elif kind == wire.IMPORTED:
            rank.imported += pickle.loads(body)

    def _fail(self, rank: WatchedRank, failure: RankFailure) -> None:
        if self._stopping_on_request and failure.collateral:
            return  # see _stopping_on_request
        if rank.failure is None:
            if failure.failed_at is None:  # found here, not reported by the rank
                failure.failed_at = time.monotonic()
            rank.failure = failure

    # ----------------------------------------------------------------------------- exits
    def _on_exit(self, process: WorkerProcess) -> None:
        code = process.wait()
        if process.exit_fd is not None and process.exit_fd in self._selector.get_map():
            self._selector.unregister(process.exit_fd)
        process.signal_group(signal.SIGKILL)  # whatever it started (DataLoader workers) goes with it
        for pipes in process.ranks:
            rank = self._ranks[pipes.rank]
            self._drain(rank)
            rank.finished = True
            self._judge(rank, code)

    def _judge(self, rank: WatchedRank, code: int) -> None:
        """Say how a rank ended, once its process has exited and its pipes are drained."""
        process = rank.process
        if rank.has_result and rank.failure is None:
            self._emit(RankFinished(rank=rank.number, state=RankState.DONE, exitcode=code))
            return
        if rank.failure is None:
            if process.killed_by_launcher or self._stopping_on_request:
                stopped = self._stopped.get(rank.number)
                detail = (f"stopped after {stopped[0]} training steps; its state is saved in {stopped[1]}" if stopped
                          else "stopped by the launcher")
                self._emit(RankFinished(rank=rank.number, state=RankState.STOPPED, detail=detail, exitcode=code))
                return
            oom_killed = self._oom_kills.rose() if code == -signal.SIGKILL else None
            self._fail(rank, failure_from_exit(rank.number, code, list(rank.tail), process.ended_because(), oom_killed))
        failure = rank.failure
        failure.exitcode = code
        if not failure.complete:
            failure.reason += " (stopped before it could send its traceback)"
        detail = "\n".join(filter(None, [failure.reason, failure.traceback.rstrip(), failure.hint]))
        self._shown_failed.append(rank.number)
        self._emit(RankFinished(rank=rank.number, state=RankState.FAILED, detail=detail, exitcode=code))

    def _failure_error(self, failures: list[WatchedRank]) -> RankFailedError:
        in_time_order = sorted((r.failure for r in failures), key=lambda f: f.failed_at)
        finished = sorted(r.number for r in self._ranks.values() if r.has_result and r.failure is None)
        return RankFailedError.blaming(in_time_order, self.stacks, self._shown_failed, finished)
