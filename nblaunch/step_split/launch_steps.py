"""What ``launch.steps`` returns: each rank's typical step (:class:`RankSteps`), the launch's verdict
(:class:`LaunchSteps`), and the same in words.

Example::

    steps = launch.steps
    steps[1].data, steps.straggler, steps.cause    # 0.024, 1, "data"
    print(steps)                                    # summary_text(steps)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

LAG_MIN_S = 0.001  # an arrival lag below it is noise, not lateness


@dataclass(frozen=True)
class RankSteps:
    """One rank's typical step, in seconds, over its last steps (``count`` were measured): each
    part averaged over the middle half of the steps by length, so the parts make the step (on a
    GPU the parts are the device's time and the step the host's: they may differ a little).

    ``arrival_lag``: how much later than the first rank this rank arrives at the gradient sync
    (None: no sync every rank took, as with one rank or FSDP). ``samples``: per step.
    """

    rank: int
    count: int
    step: float
    data: float
    compute: float
    communication: float
    optimizer: float
    other: float
    arrival_lag: float | None
    samples: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step if self.step > 0 else 0.0

    def parts(self) -> dict[str, float]:
        """The step's parts, by name, in the order displays show them."""
        return {"data": self.data, "compute": self.compute, "communication": self.communication,
                "optimizer": self.optimizer, "other": self.other}


@dataclass(frozen=True)
class LaunchSteps:
    """Every rank's steps, split: what ``launch.steps`` returns.

    ``launch.steps[1].data`` is rank 1's typical wait for data per step; ``straggler`` the rank
    that holds the others up (or None) and ``cause`` why the launch is slow: "data", "compute",
    "communication" or None. ``str(launch.steps)`` says it all in words; ``notes`` says what
    could not be measured and why.
    """

    ranks: dict[int, RankSteps] = field(default_factory=dict)
    straggler: int | None = None
    cause: str | None = None
    finding: str = ""  # the straggler or the biggest cost, in one line ("" when nothing stands out)
    advice: str = ""  # what to do about it
    buys: str = ""  # what the ranks buy together, in words
    slower_than_one: bool = False  # the ranks together train slower than one rank alone would
    notes: tuple[str, ...] = ()

    def __getitem__(self, rank: int) -> RankSteps:
        try:
            return self.ranks[rank]
        except KeyError:
            raise KeyError(f"rank {rank} measured no steps (measured: {sorted(self.ranks) or 'none'})") from None

    def __iter__(self) -> Iterator[RankSteps]:
        return iter(self.ranks.values())

    def __len__(self) -> int:
        return len(self.ranks)

    def __str__(self) -> str:
        return summary_text(self)

    def __repr__(self) -> str:
        return f"<LaunchSteps of {len(self.ranks)} ranks; straggler={self.straggler}, cause={self.cause!r}>"


def ms(seconds: float) -> str:
    """``24 ms``, ``2.4 ms``, ``1.20 s``: a duration as the displays write it."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    value = seconds * 1000
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"


def rank_line(r: RankSteps) -> str:
    """``30 ms a step: data 0.2 ms · compute 5.1 ms · ...`` for one rank."""
    parts = " · ".join(f"{name} {ms(value)}" for name, value in r.parts().items())
    rate = f"; {r.samples_per_s:,.0f} samples/s" if r.samples > 0 else ""
    lag = f"; arrives {ms(r.arrival_lag)} after the first" if (r.arrival_lag or 0.0) >= LAG_MIN_S else ""
    return f"{ms(r.step)} a step: {parts}{rate}{lag}"


def summary_text(report: LaunchSteps) -> str:
    """The whole report in lines: each rank's split, what the ranks buy, the finding, the advice."""
    if not report.ranks:
        return "\n".join(report.notes) or "no training step was measured"
    counts = sorted({r.count for r in report})
    steps = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    lines = [f"steps split: {steps} steps per rank; a typical step (the middle half by length, averaged)"]
    lines += [f"  rank {r.rank}: {rank_line(r)}" for r in report]
    lines.append(report.buys)
    if report.finding:
        lines.append(report.finding)
    if report.advice:
        lines.append(f"-> {report.advice}")
    lines += report.notes
    return "\n".join(lines)
