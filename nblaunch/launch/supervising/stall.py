"""Noticing a launch that stalled, and saying which rank holds the others up, without stopping it.

A rank stuck in a collective, a deadlock or a sleep makes no progress. When no busy rank has made
any for ``after`` seconds (a line, a bar, a metric, a call's answer, a ``MOVED`` frame from its
look-out thread: ``nblaunch.worker.movement``), the supervisor asks each for its stack (answered
from a side thread; nothing is stopped), and :func:`verdict` reads them: which ranks wait in
which collective, and where in the user's code, and which rank is elsewhere, at which line. The
cell shows it (``Stalled``) and clears it when progress resumes (``StallCleared``). A launch that
stays stalled is reported again after twice as long, then four times, so a long silent step
costs a handful of reports, not a stream of them. A warm rank between calls is idle, not stalled.

Example::

    watch = StallWatch(after=60.0, now=time.monotonic())
    watch.heard(time.monotonic())        # any progress; True if a shown stall is now over
    if watch.due(time.monotonic()):      # True once per stalled stretch (and its back-offs)
        ask_every_busy_rank_for_its_stack()
"""

from __future__ import annotations

import os
import time
from typing import Callable

from nblaunch import frames
from nblaunch.events import Event, StallCleared, Stalled

STACKS_WITHIN_S = 2.0  # how long a stall report waits for the stacks before it says what it has


class StallWatch:
    """Says when busy ranks have made no progress for ``after`` s, ``2 * after`` s, ..."""

    def __init__(self, after: float | None, now: float) -> None:
        self._after = after
        self._last_heard = now
        self._next_due = None if after is None else now + after
        self.shown = False  # a Stalled report is on show

    def heard(self, now: float) -> float | None:
        """Progress: the clock starts again. How long it had stalled, when a stall was shown."""
        stalled = now - self._last_heard if self.shown else None
        self._last_heard = now
        if self._after is not None:
            self._next_due = now + self._after
        self.shown = False
        return stalled

    def wait(self, now: float) -> float | None:
        """Seconds until the next report falls due (None: never)."""
        return None if self._next_due is None else max(0.0, self._next_due - now)

    def due(self, now: float) -> bool:
        if self._next_due is None or now < self._next_due:
            return False
        silent_for = now - self._last_heard
        self._next_due = self._last_heard + 2 * silent_for  # back off: 60 s, 120 s, 240 s, ...
        return True

    def silent_for(self, now: float) -> float:
        return now - self._last_heard


class StallReports:
    """The supervisor's side of stalls: when to ask for the stacks, when to report what they say,
    when it is over. Runs on the supervisor's thread, as ``emit`` must."""

    def __init__(self, after: float | None, emit: Callable[[Event], None], first_rank: int = 0) -> None:
        self._watch = StallWatch(after, time.monotonic())
        self._emit = emit
        self._first_rank = first_rank  # this node's first global rank: the verdict names ranks as the cell does
        self._asked: tuple[float, list[int]] | None = None  # (report due by, ranks asked)

    def heard(self) -> None:
        stalled = self._watch.heard(time.monotonic())
        self._asked = None
        if stalled is not None:
            self._emit(StallCleared(after_s=stalled))

    def wait(self, now: float) -> float | None:
        """Seconds until something is due here (None: nothing)."""
        waits = [w for w in (self._watch.wait(now), None if self._asked is None else self._asked[0] - now)
                 if w is not None]
        return max(0.0, min(waits)) if waits else None

    def due(self) -> bool:
        """Time to ask the busy ranks where they are."""
        return self._asked is None and self._watch.due(time.monotonic())

    def asked(self, ranks: list[int]) -> None:
        if not ranks:  # warm ranks between calls are idle, not stalled
            self._watch.heard(time.monotonic())
            return
        self._asked = (time.monotonic() + STACKS_WITHIN_S, ranks)

    def report_when_answered(self, stacks: dict[int, str], counts: dict[int, dict[str, tuple[int, int]]] | None = None) -> None:
        """Once every rank asked answered (or the time for it is up), show the stall; ``counts``:
        the collectives each rank counted, ``{rank: {kind: (entered, left)}}``."""
        if self._asked is None:
            return
        due_by, asked = self._asked
        if time.monotonic() < due_by and not all(r in stacks for r in asked):
            return
        self._asked = None
        answered = {self._first_rank + r: stacks[r] for r in asked if r in stacks}
        counted = {self._first_rank + r: c for r, c in (counts or {}).items() if r in asked}
        silent = self._watch.silent_for(time.monotonic())
        self._watch.shown = True
        self._emit(Stalled(silent_s=silent, verdict=verdict(answered, silent, counted) if answered else
                           f"no rank made progress for {silent:.0f} s, and none said where it is"))


def collective_of(stack: str) -> str:
    """The collective the rank's main thread waits in ("all_reduce", "backward" where a DDP model
    all-reduces its gradients), or ""."""
    found = ""
    for path, _, function, _ in frames.first_frames(stack):
        parts = path.replace(os.sep, "/")
        if "/torch/distributed/" in parts and not function.startswith("_") and function != "wrapper" and not found:
            found = function  # the outermost of torch.distributed's own: the call the user made
        elif "/torch/autograd/" in parts and function == "backward" and not found:
            found = "backward"
    return found


def verdict(stacks: dict[int, str], silent_s: float, counts: dict[int, dict[str, tuple[int, int]]] | None = None) -> str:
    """One block for a stall: who waits in what, where, and who is elsewhere; by count where the
    ranks counted their collectives (a collective under NCCL returns before it is done, so the
    stack of the rank that waits is somewhere later, and only counts tell)."""
    waiting: dict[tuple[str, str], list[int]] = {}
    elsewhere: dict[int, str] = {}
    for rank in sorted(stacks):
        place = frames.where(stacks[rank]) or "(no Python frame: in C code)"
        op = collective_of(stacks[rank])
        if op:
            waiting.setdefault((op, place), []).append(rank)
        else:
            elsewhere[rank] = place
    lines = [f"no rank made progress for {silent_s:.0f} s; nothing was stopped"]
    by_count = counted_line(counts or {}, stacks)
    if by_count:
        lines.append(by_count)
    for (op, place), ranks in waiting.items():
        shown = "s " + ", ".join(map(str, ranks)) if len(ranks) > 1 else f" {ranks[0]}"
        lines.append(f"rank{shown} wait{'' if len(ranks) > 1 else 's'} in {op} ({place})")
    for rank, place in elsewhere.items():
        lines.append(f"rank {rank} is elsewhere, at {place}")
    if waiting and elsewhere:
        who = " and ".join(f"rank {r}" for r in elsewhere)
        lines.append(f"-> the collective waits for {who}, which is not in it")
    elif len(waiting) > 1:
        lines.append("-> the ranks wait in different collectives: their code took different paths")
    elif waiting:
        lines.append("-> every rank waits in the same collective: a rank outside this launch, or another "
                     "process group, holds it up")
    else:
        lines.append("-> no rank is in a collective: each waits where its own code is (a sleep, a lock, a slow call)")
    return "\n".join(lines)


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def counted_line(counts: dict[int, dict[str, tuple[int, int]]], stacks: dict[int, str]) -> str:
    """``rank 0 waits in its 7th gradient sync; rank 1 has entered 6, and is at train.py:71``: for
    the first kind of collective the ranks have not all entered as often, or "" when none."""
    kinds = dict.fromkeys(kind for c in counts.values() for kind in c)
    for kind in kinds:
        entered = {rank: c.get(kind, (0, 0))[0] for rank, c in sorted(counts.items())}
        most = max(entered.values())
        if min(entered.values()) == most:
            continue
        ahead = [r for r, n in entered.items() if n == most and counts[r].get(kind, (0, 0))[1] < most]
        behind = [r for r, n in entered.items() if n < most]
        said = []
        if ahead:
            who = f"rank {ahead[0]} waits" if len(ahead) == 1 else f"ranks {', '.join(map(str, ahead))} wait"
            said.append(f"{who} in {'its' if len(ahead) == 1 else 'their'} {_nth(most)} {kind}")
        for rank in behind:
            place = frames.where(stacks.get(rank, ""))
            said.append(f"rank {rank} has entered {entered[rank]}" + (f", and is at {place}" if place else ""))
        return "; ".join(said)
    return ""
