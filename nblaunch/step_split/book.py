"""The launcher's book of every rank's steps, and the report made from it.

A rank sends each step it took as a :data:`StepRecord`: its number and, in seconds, the whole
step and its parts (waiting for data; forward and backward compute; communication the compute
did not hide; the optimizer step), how long it waited in its gradient sync (the part of
communication that says when it arrived) and how many samples it took. What the parts leave of
the step is the rest (``other``: the user's own code between).

A rank that arrives late at a gradient sync waits there least: the others wait for it. So for
each sync every rank took, this rank's *arrival lag* is the longest wait of any rank minus its own
-- no clock is compared across processes or machines.

Example::

    book = StepBook(num_ranks=2)
    book.add(0, [(1, 0.030, 0.0, 0.005, 0.024, 0.001, 0.024, 8)])
    book.add(1, [(1, 0.030, 0.024, 0.005, 0.0, 0.001, 0.0, 8)])
    book.report()[1].arrival_lag      # 0.024
"""

from __future__ import annotations

import collections
import statistics
import threading

from nblaunch.step_split import verdict
from nblaunch.step_split.launch_steps import LaunchSteps, RankSteps

# (index, step, data, compute, communication, optimizer, sync_wait, samples); sync_wait is -1.0
# for a step without a gradient sync, samples 0 where the batches had no length.
StepRecord = tuple[int, float, float, float, float, float, float, int]

WINDOW = 10_000  # steps kept per rank: the report is of the last ones
LIVE = 200  # steps the live view reports on: what the ranks do now
_PENDING_SYNCS = 4 * WINDOW  # syncs waiting for a rank that fell behind (or left), at most


class StepBook:
    """Collects ``StepRecord`` batches per rank (from any thread) and reports on them."""

    def __init__(self, num_ranks: int = 0) -> None:
        self._lock = threading.Lock()
        self.num_ranks = num_ranks  # how many ranks a sync waits for before its lags are known
        self._records: dict[int, collections.deque[StepRecord]] = {}
        self._counts: dict[int, int] = {}
        self._lags: dict[int, collections.deque[float]] = {}
        self._syncs: dict[int, dict[int, float]] = {}  # step index -> rank -> its wait in that step's sync
        self._notes: dict[str, None] = {}  # ordered, each once

    def add(self, rank: int, records: list[StepRecord] | tuple[StepRecord, ...]) -> None:
        with self._lock:
            kept = self._records.setdefault(rank, collections.deque(maxlen=WINDOW))
            kept.extend(records)
            self._counts[rank] = self._counts.get(rank, 0) + len(records)
            for record in records:
                if record[6] >= 0:
                    self._line_up(record[0], rank, record[6])

    def note(self, text: str) -> None:
        """Something the split could not measure, said once in the report."""
        with self._lock:
            self._notes[text] = None

    def clear(self) -> None:
        """Forget every step and note (a restart, or a warm pool's next call, begins a new count)."""
        with self._lock:
            self._notes.clear()
            self._records.clear()
            self._counts.clear()
            self._lags.clear()
            self._syncs.clear()

    def _line_up(self, index: int, rank: int, wait: float) -> None:
        waits = self._syncs.setdefault(index, {})
        waits[rank] = wait
        if len(waits) >= max(self.num_ranks, 2):
            del self._syncs[index]
            longest = max(waits.values())
            for r, w in waits.items():
                self._lags.setdefault(r, collections.deque(maxlen=WINDOW)).append(longest - w)
        elif len(self._syncs) > _PENDING_SYNCS:
            del self._syncs[next(iter(self._syncs))]  # the oldest: a rank left before taking it

    def report(self, recent: int | None = None) -> LaunchSteps:
        """Each rank's typical step over its last ``recent`` steps (None: all it keeps), and the verdict."""
        with self._lock:
            ranks = {rank: _typical(rank, self._counts[rank], list(records)[-recent:] if recent else list(records),
                                    list(self._lags.get(rank, ()))[-recent:] if recent else list(self._lags.get(rank, ())))
                     for rank, records in sorted(self._records.items()) if records}
            notes = tuple(self._notes)
        found = verdict.judge(ranks)
        return LaunchSteps(ranks=ranks, straggler=found.straggler, cause=found.cause, finding=found.finding,
                           advice=found.advice, buys=found.buys, slower_than_one=found.slower_than_one, notes=notes)


def _typical(rank: int, count: int, records: list[StepRecord], lags: list[float]) -> RankSteps:
    """The rank's typical step: each part averaged over the middle half of its steps by length.

    Not each part's own median: those need not add up to the step (a sync that is slow every
    other step has a median of the fast ones), and the parts must make the step they split. The
    middle half leaves out the first steps' warm-up and the pauses at either end.
    """
    ordered = sorted(records, key=lambda r: r[1])
    quarter = len(ordered) // 4
    middle = ordered[quarter:len(ordered) - quarter]

    def mean(column: int) -> float:
        return statistics.fmean(r[column] for r in middle)

    step, data, compute, communication, optimizer = (mean(c) for c in range(1, 6))
    other = statistics.fmean(max(0.0, r[1] - r[2] - r[3] - r[4] - r[5]) for r in middle)
    return RankSteps(rank=rank, count=count, step=step, data=data, compute=compute, communication=communication,
                     optimizer=optimizer, other=other, arrival_lag=statistics.median(lags) if lags else None,
                     samples=mean(7))
