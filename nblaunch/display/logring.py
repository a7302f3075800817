"""The last lines of a stream of output, in bounded memory.

A launch can print millions of lines; the page only ever shows the tail, and the whole log is
on disk (``LaunchStarted.log_dir``). A ring keeps the last ``capacity`` lines, counts the rest,
and keeps at most one "transient" line per rank: a line ended by a carriage return (a progress
bar redrawing itself) that the rank's next line replaces.

Example::

    ring = LogRing(capacity=2)
    ring.add(LogLine(0, "stdout", "a"))
    ring.add(LogLine(0, "stdout", "b"))
    ring.add(LogLine(0, "stdout", "c"))
    [line.text for line in ring.view()]  # ["b", "c"]; ring.total == 3
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MAX_LINE_CHARS = 2000  # one 10 MB line must not defeat the bound


@dataclass(frozen=True)
class LogLine:
    rank: int
    stream: str  # "stdout" or "stderr"
    text: str


class LogRing:
    """The last ``capacity`` lines (of one rank, or of all ranks merged)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.total = 0  # lines ever added, transient ones excepted
        self._lines: deque[LogLine] = deque(maxlen=capacity)
        self._transient: dict[int, LogLine] = {}  # rank -> its line being redrawn

    def add(self, line: LogLine, transient: bool = False) -> None:
        if len(line.text) > MAX_LINE_CHARS:
            line = LogLine(line.rank, line.stream, line.text[:MAX_LINE_CHARS] + " …[line cut]")
        if transient:
            self._transient[line.rank] = line
            return
        self._transient.pop(line.rank, None)
        self._lines.append(line)
        self.total += 1

    def extend(self, rank: int, stream: str, texts: tuple[str, ...] | list[str]) -> None:
        """Add whole lines of one rank at once. Only the last ``capacity`` of them can stay, so
        only those become LogLines: a rank printing 100k lines costs a slice, not a loop."""
        self._transient.pop(rank, None)
        self.total += len(texts)
        for text in texts[-self.capacity :]:
            if len(text) > MAX_LINE_CHARS:
                text = text[:MAX_LINE_CHARS] + " …[line cut]"
            self._lines.append(LogLine(rank, stream, text))

    def view(self) -> list[LogLine]:
        """The kept lines, oldest first, then any line still being redrawn."""
        return [*self._lines, *self._transient.values()]

    @property
    def dropped(self) -> int:
        """How many lines fell out of the ring."""
        return self.total - len(self._lines)
