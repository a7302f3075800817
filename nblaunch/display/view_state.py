"""What a display knows about a launch: the events folded into one bounded picture.

:class:`LaunchView` takes events one by one (``apply``) and remembers only what a dashboard
shows: the plan, each rank's state, bars, last line and log tail, metric series and stacks.
It also records which parts changed (``dirty``) so a display redraws only those. It has no
widgets and no threads; the widget display owns the lock and the timer.

Example::

    view = LaunchView(max_lines=100)
    view.apply(LaunchStarted(...), now=time.monotonic())
    view.apply(Output(rank=0, stream="stdout", lines=("hello",)), now=time.monotonic())
    view.ranks[0].log.view()[-1].text  # "hello"
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nblaunch.display.logring import LogLine, LogRing
from nblaunch.display.series import Series
from nblaunch.events import (
    ClusterWaiting,
    LaunchStopping,
    StallCleared,
    Stalled,
    Event,
    GpuUsage,
    LaunchFinished,
    LaunchRestarting,
    LaunchStarted,
    Metrics,
    Output,
    Progress,
    RankCompiling,
    RankDevice,
    RankFinished,
    RanksPlaced,
    RankStarted,
    RankState,
    Stacks,
    StepTimes,
)
from nblaunch.step_split import LaunchSteps, StepBook
from nblaunch.step_split.book import LIVE

# Names of the parts of the picture, as found in ``LaunchView.dirty``.
HEADER, RANKS, METRICS, MERGED_LOG, STACKS, SUMMARY = "header", "ranks", "metrics", "log:all", "stacks", "summary"


def rank_log(rank: int) -> str:
    return f"log:{rank}"


@dataclass
class Bar:
    """One progress bar of one rank; times are the display's clock when events arrived."""

    bar_id: int
    n: float
    total: float | None
    desc: str
    closed: bool
    first_n: float
    first_t: float
    last_t: float
    auto: bool = False  # nblaunch's own bar (see nblaunch.events.Progress)

    def rate(self) -> float | None:
        """Items per second since the bar was first seen."""
        dt = self.last_t - self.first_t
        return (self.n - self.first_n) / dt if dt > 0 and self.n > self.first_n else None


@dataclass
class RankView:
    rank: int
    log: LogRing
    state: RankState = RankState.STARTING
    pid: int | None = None
    started_t: float | None = None
    finished_t: float | None = None
    bars: dict[int, Bar] = field(default_factory=dict)  # open bars, in creation order
    last_closed: Bar | None = None  # shown when no bar is open
    draws_own_bars: bool = False  # then nblaunch's own (a prepared DataLoader's) are not shown
    last_line: str = ""
    last_heard_t: float | None = None  # the last output, progress or metric
    detail: str = ""
    exitcode: int | None = None
    stacks: str | None = None
    stacks_why: str = "stop"  # see nblaunch.events.Stacks
    stacks_at: str = ""  # wall-clock time the stacks came, for the reader
    device: RankDevice | None = None  # what its Accelerator computes on, and in which precision
    compiling_since: float | None = None  # a torch.compile going on began then
    compiled_s: float = 0.0  # seconds its compiles took so far
    gpu: GpuUsage | None = None  # its GPU a moment ago

    def shown_bars(self) -> list[Bar]:
        """Open bars (outer loop first), or the last finished one."""
        shown = [bar for bar in self.bars.values() if self.shows(bar)]
        if not shown and self.last_closed is not None and self.shows(self.last_closed):
            shown = [self.last_closed]
        return shown

    def shows(self, bar: Bar) -> bool:
        return not (bar.auto and self.draws_own_bars)


class LaunchView:
    """Everything shown about one launch, bounded by ``max_lines`` and ``max_points``."""

    def __init__(self, max_lines: int = 500, max_points: int = 1000) -> None:
        self.max_lines = max_lines
        self.max_points = max_points
        self.plan: LaunchStarted | None = None
        self.started_t: float | None = None
        self.finished: LaunchFinished | None = None
        self.ranks: dict[int, RankView] = {}
        self.merged = LogRing(max_lines)
        # metric name -> rank -> series; dicts keep first-seen order, so charts do not jump around
        self.metrics: dict[str, dict[int, Series]] = {}
        self._implicit_steps: dict[tuple[str, int], int] = {}
        self.restarted: LaunchRestarting | None = None  # the latest restart, if any
        self.placed: RanksPlaced | None = None  # where a cluster put the ranks
        self.stopping: LaunchStopping | None = None  # stopping at a common step to save the work
        self.waiting: ClusterWaiting | None = None  # why the cluster has not yet
        self.stall: Stalled | None = None  # who holds the others up, while no rank makes progress
        self.step_book = StepBook()  # the ranks' steps, split (nblaunch.step_split)
        self._live_steps: LaunchSteps | None = None  # the last LIVE steps' report, until more come
        self.dirty: set[str] = set()

    # -- overall ----------------------------------------------------------------------------

    @property
    def state(self) -> RankState:
        if self.finished is not None:
            return self.finished.state
        if any(r.state is not RankState.STARTING for r in self.ranks.values()):
            return RankState.RUNNING
        return RankState.STARTING

    def elapsed(self, now: float) -> float:
        if self.finished is not None:
            return self.finished.elapsed_s
        return now - self.started_t if self.started_t is not None else 0.0

    def log_path(self, rank: int) -> str | None:
        log_dir = self.plan.log_dir if self.plan else None
        return f"{log_dir.rstrip('/')}/rank{rank}.log" if log_dir else None

    def steps(self) -> LaunchSteps:
        """The step split to show: the launch's own once it is over, else the ranks' last steps."""
        if self.finished is not None and self.finished.steps is not None:
            return self.finished.steps
        if self._live_steps is None:
            self._live_steps = self.step_book.report(recent=LIVE)
        return self._live_steps

    # -- events -----------------------------------------------------------------------------

    def apply(self, event: Event, now: float) -> None:
        """Fold one event into the picture and mark what changed."""
        if isinstance(event, Output):
            self._output(event, now)
        elif isinstance(event, Progress):
            self._progress(event, now)
        elif isinstance(event, Metrics):
            self._metrics(event)
            self.rank(event.rank).last_heard_t = now
        elif isinstance(event, StepTimes):
            self.step_book.add(event.rank, event.steps)
            if event.note:
                self.step_book.note(event.note)
            self._live_steps = None
            self.rank(event.rank).last_heard_t = now
            self.dirty |= {RANKS, HEADER}
        elif isinstance(event, RankStarted):
            rank = self.rank(event.rank)
            rank.state, rank.pid, rank.started_t, rank.last_heard_t = RankState.RUNNING, event.pid, now, now
            self.dirty |= {RANKS, HEADER}
        elif isinstance(event, RankFinished):
            rank = self.rank(event.rank)
            rank.state, rank.detail, rank.exitcode = event.state, event.detail, event.exitcode
            rank.finished_t = now
            self.dirty |= {RANKS, HEADER}
        elif isinstance(event, RankDevice):
            self.rank(event.rank).device = event
            self.dirty.add(RANKS)
        elif isinstance(event, RankCompiling):
            rank = self.rank(event.rank)
            rank.compiling_since = now if event.compiling else None
            rank.compiled_s += event.seconds
            rank.last_heard_t = now
            self.dirty.add(RANKS)
        elif isinstance(event, GpuUsage):
            self.rank(event.rank).gpu = event
            self.dirty.add(RANKS)
        elif isinstance(event, Stacks):
            rank = self.rank(event.rank)
            rank.stacks, rank.stacks_why, rank.stacks_at = event.text, event.why, time.strftime("%H:%M:%S")
            self.dirty |= {RANKS, STACKS, SUMMARY}
        elif isinstance(event, Stalled):
            self.stall = event
            self.dirty |= {STACKS, SUMMARY}
        elif isinstance(event, StallCleared):
            self.stall = None
            for rank in self.ranks.values():  # where they were stalled is no longer where they are
                if rank.stacks_why == "quiet":
                    rank.stacks = None
            self.dirty |= {RANKS, STACKS, SUMMARY}
        elif isinstance(event, LaunchStarted):
            self.plan, self.started_t = event, now
            self.step_book.num_ranks = event.num_processes
            for r in range(event.num_processes):
                self.rank(r)
            self.dirty |= {HEADER, RANKS}
        elif isinstance(event, RanksPlaced):
            self.placed = event
            self.dirty.add(HEADER)
        elif isinstance(event, ClusterWaiting):
            self.waiting = event
            self.dirty.add(HEADER)
        elif isinstance(event, LaunchStopping):
            self.stopping = event
            self.dirty.add(HEADER)
        elif isinstance(event, LaunchRestarting):
            self._restart(event)
        elif isinstance(event, LaunchFinished):
            self.finished = event
            self.dirty |= {HEADER, RANKS, SUMMARY}

    def rank(self, rank: int) -> RankView:
        view = self.ranks.get(rank)
        if view is None:
            view = self.ranks[rank] = RankView(rank, LogRing(self.max_lines))
            self.ranks = dict(sorted(self.ranks.items()))
        return view

    def _restart(self, event: LaunchRestarting) -> None:
        """Every rank starts again: fresh rank rows, the logs keep what came before."""
        self.restarted = event
        self.step_book.clear()
        self._live_steps = None
        line = f"--- {event.line} ---"
        for number, old in list(self.ranks.items()):
            fresh = self.ranks[number] = RankView(number, old.log)
            fresh.log.extend(number, "stderr", (line,))
            self.dirty.add(rank_log(number))
        self.merged.extend(event.failed_rank, "stderr", (line,))
        self.dirty |= {HEADER, RANKS, MERGED_LOG}

    def _output(self, event: Output, now: float) -> None:
        rank = self.rank(event.rank)
        if event.transient:
            line = LogLine(event.rank, event.stream, event.lines[0])
            rank.log.add(line, transient=True)
            self.merged.add(line, transient=True)
        else:
            rank.log.extend(event.rank, event.stream, event.lines)
            self.merged.extend(event.rank, event.stream, event.lines)
        rank.last_heard_t = now
        for text in reversed(event.lines):  # the last line with something on it
            if text.strip():
                rank.last_line = text
                break
        self.dirty |= {RANKS, rank_log(event.rank), MERGED_LOG}

    def _progress(self, event: Progress, now: float) -> None:
        rank = self.rank(event.rank)
        rank.last_heard_t = now
        rank.draws_own_bars |= not event.auto
        bar = rank.bars.get(event.bar_id)
        if bar is None:
            bar = Bar(event.bar_id, event.n, event.total, event.desc, event.closed, event.n, now, now, event.auto)
            rank.bars[event.bar_id] = bar
        bar.n, bar.total, bar.desc, bar.closed, bar.last_t = (
            event.n, event.total, event.desc, event.closed, now
        )
        if event.closed:
            closed = rank.bars.pop(event.bar_id)
            if rank.shows(closed):  # a hidden bar ending does not replace the user's last one
                rank.last_closed = closed
        self.dirty.add(RANKS)

    def _metrics(self, event: Metrics) -> None:
        for name, value in event.values.items():
            series = self.metrics.setdefault(name, {})
            if event.rank not in series:
                series[event.rank] = Series(self.max_points)
                self.metrics[name] = dict(sorted(series.items()))
            if event.step is not None:
                step = event.step
            else:  # no step given: number the values of this metric and rank 0, 1, 2, ...
                key = (name, event.rank)
                step = self._implicit_steps.get(key, 0)
                self._implicit_steps[key] = step + 1
            self.metrics[name][event.rank].add(float(step), float(value))
        self.dirty.add(METRICS)
