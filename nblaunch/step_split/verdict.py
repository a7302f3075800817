"""Reading the ranks' typical steps: who holds the others up and why, what the ranks buy, what to do.

The straggler is the rank that arrives last at the gradient sync, by a margin (``LAG_SHARE`` of
its step, at least ``STRAGGLER_MIN_S``: ranks sharing a CPU arrive a millisecond apart by
chance), and only where a part of its own step explains most of the lag (``EXPLAINED_SHARE``: a
rank the scheduler set aside for a few milliseconds of a busy CPU is late by chance, and
"it computes slower" would be wrong advice). DDP's sync evens out the step times, so the arrival lag is what names a rank slow in
computing. Why it is late is the part of its step before the sync that
exceeds the others' most: its wait for data ("data"), or its forward, backward or own code
("compute"). Without a straggler, a launch is slow for one reason when communication or the wait
for data is the largest part of the step and at least ``SLOW_SHARE`` of it.

Example::

    found = judge({0: RankSteps(...), 1: RankSteps(...)})
    found.straggler, found.cause, found.finding   # 1, "data", "rank 1 holds the others up: ..."
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from nblaunch.step_split.launch_steps import RankSteps, ms

LAG_SHARE = 0.15
STRAGGLER_MIN_S = 0.002
SLOW_SHARE = 0.25
EXPLAINED_SHARE = 0.5
_OWN_PARTS = ("data", "compute", "other")  # a rank's step before the sync: what can make it late


@dataclass(frozen=True)
class Verdict:
    straggler: int | None = None
    cause: str | None = None
    finding: str = ""
    advice: str = ""
    buys: str = ""
    slower_than_one: bool = False


def judge(ranks: dict[int, RankSteps]) -> Verdict:
    """What every rank's typical step says (see the module's docstring)."""
    if not ranks:
        return Verdict()
    buys, slower = _what_the_ranks_buy(list(ranks.values()))
    late = _straggler(ranks)
    if late is not None:
        cause, finding, advice = _why_late(ranks, late)
        return Verdict(late, cause, finding, advice, buys, slower)
    cause, finding, advice = _biggest_cost(list(ranks.values()))
    return Verdict(None, cause, finding, advice, buys, slower)


def _straggler(ranks: dict[int, RankSteps]) -> int | None:
    lagging = [r for r in ranks.values() if r.arrival_lag is not None]
    if len(lagging) < 2:
        return None
    last = max(lagging, key=lambda r: r.arrival_lag or 0.0)
    lag = last.arrival_lag or 0.0
    if lag < max(STRAGGLER_MIN_S, LAG_SHARE * last.step):
        return None
    if max(_excess(ranks, last.rank).values()) < EXPLAINED_SHARE * lag:
        return None
    return last.rank


def _excess(ranks: dict[int, RankSteps], late: int) -> dict[str, float]:
    """How much longer each part of its own step takes on rank ``late`` than the others' median."""
    others = [r for r in ranks.values() if r.rank != late]
    return {part: getattr(ranks[late], part) - statistics.median(getattr(o, part) for o in others)
            for part in _OWN_PARTS}


def _why_late(ranks: dict[int, RankSteps], late: int) -> tuple[str, str, str]:
    slow = ranks[late]
    others = [r for r in ranks.values() if r.rank != late]
    excess = _excess(ranks, late)
    part = max(excess, key=lambda p: excess[p])
    waiting = statistics.median(o.communication for o in others)
    who = (f"rank {others[0].rank} waits" if len(others) == 1
           else f"ranks {', '.join(str(o.rank) for o in others)} wait")
    they_wait = f"{who} {ms(waiting)} for it in the gradient sync"
    head = f"rank {late} holds the others up: "
    if part == "data":
        return ("data", head + f"it waits {ms(slow.data)} a step for data; {they_wait}",
                f"give rank {late}'s batches more hands: DataLoader(..., num_workers=4, pin_memory=True), "
                "or find what makes its dataset slow")
    what = "its forward and backward take" if part == "compute" else "its own code between the steps takes"
    return ("compute", head + f"{what} {ms(getattr(slow, part))} a step, {ms(excess[part])} more than the "
            f"others'; {they_wait}",
            f"rank {late} computes slower than the others: is its work uneven (a bigger batch, longer "
            "sequences), or its device shared or throttled?")


def _biggest_cost(ranks: list[RankSteps]) -> tuple[str | None, str, str]:
    step = statistics.median(r.step for r in ranks)
    if step <= 0:
        return None, "", ""
    share = {part: statistics.median(r.parts()[part] for r in ranks) for part in ranks[0].parts()}
    largest = max(share, key=lambda p: share[p])
    if largest == "communication" and share[largest] >= SLOW_SHARE * step:
        return ("communication",
                f"communication takes {share[largest] / step:.0%} of each step ({ms(share[largest])} of {ms(step)})",
                "sync less often: a bigger batch per rank, or gradient accumulation "
                "(Accelerator(gradient_accumulation_steps=4) with accelerator.accumulate(model))")
    if largest == "data" and share[largest] >= SLOW_SHARE * step:
        return ("data", f"the ranks wait for data: {ms(share[largest])} of each {ms(step)} step",
                "DataLoader(..., num_workers=4, pin_memory=True) makes batches while the ranks compute")
    return None, "", ""


def _what_the_ranks_buy(ranks: list[RankSteps]) -> tuple[str, bool]:
    counted = all(r.samples > 0 for r in ranks)
    unit = "samples/s" if counted else "steps/s"

    def rate(work_s: float, r: RankSteps) -> float:
        return (r.samples if counted else 1.0) / work_s if work_s > 0 else 0.0

    together = sum(rate(r.step, r) for r in ranks)
    alone = sum(rate(r.compute + r.optimizer, r) for r in ranks)
    words = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}: {together:,.0f} {unit} in all"
    if alone > 0:
        words += f", {together / alone:.0%} of what their compute alone would give ({alone:,.0f} {unit})"
    if len(ranks) < 2:
        return words, False
    # The slowest rank alone, without the communication: flagged only when even it would beat them all.
    one = min(rate(max(r.step - r.communication, 1e-9), r) for r in ranks)
    if together < one:
        return words + (f"; slower than one rank alone would be (about {one:,.0f} {unit}, without the "
                        "communication)"), True
    return words, False
