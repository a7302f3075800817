"""Plain-text display: every event as a line tagged with its rank.

Used in terminals, scripts, CI and frontends without a widget manager. It prints from the
launching thread, so in a notebook the lines land in the cell that launched.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from nblaunch import frames
from nblaunch.display import step_view
from nblaunch.step_split import StepBook
from nblaunch.step_split.book import LIVE
from nblaunch.events import (
    ClusterWaiting,
    LaunchStopping,
    StallCleared,
    Stalled,
    StepTimes,
    Event,
    LaunchFinished,
    LaunchRestarting,
    LaunchStarted,
    Metrics,
    Output,
    Progress,
    RankCompiling,
    RankFinished,
    RanksPlaced,
    RankState,
    Stacks,
)

_REDRAW_EVERY_S = 2.0  # progress bars and \r-lines: a line every so often, not every redraw
_METRICS_EVERY_S = 1.0
_STEPS_EVERY_S = 10.0  # each rank's step split, and the finding: a few lines every so often
_STARTED_BY = {"server": "the launch server"}  # a plan's start method, as the launch's line says it


class TextDisplay:
    """Prints ``[rank r] ...`` lines; ranks' stderr goes to the launcher's stderr."""

    prints_to_cell = True  # a non-blocking launch must print from the launching cell's context

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None):
        self._out = out
        self._err = err
        self._last_shown: dict[tuple, float] = {}
        self._last_metrics: dict[int, tuple[dict, int | None]] = {}
        self._log_dir: str | None = None
        self._steps = StepBook()  # for the lines every _STEPS_EVERY_S; the end's summary is the launch's
        self._steps_shown_at: float | None = None

    # Resolved per call: in a notebook sys.stdout is swapped per cell.
    def _stream(self, stream: str) -> TextIO:
        if stream == "stderr":
            return self._err or sys.stderr
        return self._out or sys.stdout

    def _due(self, key: tuple, every: float) -> bool:
        now = time.monotonic()
        if now - self._last_shown.get(key, -every) >= every:
            self._last_shown[key] = now
            return True
        return False

    def _print(self, text: str, stream: str = "stdout") -> None:
        out = self._stream(stream)
        out.write(text + "\n")
        out.flush()

    def on_event(self, event: Event) -> None:
        if isinstance(event, Output):
            if event.transient and not self._due(("line", event.rank), _REDRAW_EVERY_S):
                return
            prefix = f"[rank {event.rank}] "
            self._print(prefix + ("\n" + prefix).join(event.lines), event.stream)  # one join: 100k lines a second
        elif isinstance(event, LaunchStarted):
            self._log_dir = event.log_dir
            self._print(
                f"nblaunch: {event.function_name} on {event.num_processes} "
                f"process{'' if event.num_processes == 1 else 'es'} ({event.devices}), "
                + ("on warm ranks" if event.start_method == "warm"
                   else f"started by {_STARTED_BY.get(event.start_method, event.start_method)}")
                + f" ({event.start_reason}), meeting at {event.rendezvous}"
                + (f"; logs in {event.log_dir}" if event.log_dir else "")
            )
        elif isinstance(event, Progress):
            if event.auto:
                return  # a log of lines has no room for bars the user did not ask for
            if event.closed or self._due(("bar", event.rank, event.bar_id), _REDRAW_EVERY_S):
                of = f"/{event.total:g}" if event.total else ""
                self._print(f"[rank {event.rank}] {event.desc + ': ' if event.desc else ''}{event.n:g}{of}")
        elif isinstance(event, Metrics):
            self._last_metrics[event.rank] = (event.values, event.step)
            if self._due(("metrics", event.rank), _METRICS_EVERY_S):
                self._print_metrics(event.rank, event.values, event.step)
                self._last_metrics.pop(event.rank)
        elif isinstance(event, StepTimes):
            self._steps.add(event.rank, event.steps)
            now = time.monotonic()
            if self._steps_shown_at is None:  # the first lines once the ranks have stepped a while
                self._steps_shown_at = now
            elif now - self._steps_shown_at >= _STEPS_EVERY_S:
                self._steps_shown_at = now
                for line in step_view.live_lines(self._steps.report(recent=LIVE)):
                    self._print(line)
        elif isinstance(event, Stacks):
            # One line: where the rank was; the whole stack of every thread is in its log.
            where = frames.where(event.text) or "(no stack)"
            log = f" (whole stack: {os.path.join(self._log_dir, f'rank{event.rank}.log')})" if self._log_dir else ""
            said = {"stop": "stopped at", "asked": "now at", "quiet": "quiet for a while, now at"}[event.why]
            self._print(f"[rank {event.rank}] {said} {where}{log}", "stderr")
        elif isinstance(event, RankFinished):
            if event.state == RankState.FAILED:
                self._print(f"[rank {event.rank}] failed: {event.detail.splitlines()[0]}", "stderr")
            elif event.state == RankState.STOPPED:
                self._print(f"[rank {event.rank}] stopped: {event.detail}", "stderr")
        elif isinstance(event, RankCompiling):
            # A line when a long compile begins and ends, at most one pair a minute per rank:
            # graph breaks and recompiles are many short compiles.
            if event.compiling and self._due(("compiling", event.rank), 60.0):
                self._print(f"[rank {event.rank}] compiling (torch.compile)...")
            elif not event.compiling and event.seconds >= 1:
                self._print(f"[rank {event.rank}] compiled in {event.seconds:.1f} s")
        elif isinstance(event, Stalled):
            self._print("nblaunch: stalled: " + event.verdict.replace("\n", "\n  "), "stderr")  # one block
        elif isinstance(event, StallCleared):
            self._print(f"nblaunch: progress again, after {event.after_s:.0f} s without", "stderr")
        elif isinstance(event, LaunchRestarting):
            self._print(f"nblaunch: {event.line}", "stderr")
        elif isinstance(event, RanksPlaced):
            self._print(f"nblaunch: {event.line}")
        elif isinstance(event, ClusterWaiting):
            self._print(f"nblaunch: {event.line}")
        elif isinstance(event, LaunchStopping):
            self._print(f"nblaunch: {event.line}", "stderr")
        elif isinstance(event, LaunchFinished):
            for rank, (values, step) in sorted(self._last_metrics.items()):
                self._print_metrics(rank, values, step)  # the latest values are never skipped
            self._last_metrics.clear()
            if event.steps is not None and event.state == RankState.DONE:  # a stop says only why (launch.steps keeps it)
                self._print("nblaunch: " + str(event.steps).replace("\n", "\n  "))
            self._print(f"nblaunch: {event.summary}", "stdout" if event.state == RankState.DONE else "stderr")

    def _print_metrics(self, rank: int, values: dict, step: int | None) -> None:
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
        self._print(f"[rank {rank}] {'step %d: ' % step if step is not None else ''}{shown}")

    def close(self) -> None:
        pass
