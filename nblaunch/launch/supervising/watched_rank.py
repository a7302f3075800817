"""What the supervisor keeps for one rank while it watches it: its pipes and process, what it
sent so far, how it ended (:class:`WatchedRank`), and its output cut into lines
(:class:`LineSplitter`)."""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from nblaunch import wire
from nblaunch.contract.failure import RankFailure
from nblaunch.launch.processes.processes import RankPipes, WorkerProcess

LOG_TAIL = 20  # lines kept to explain a rank that died without a report


class WatchedRank:
    """One rank's pipes, its process, what it sent so far and how it ended."""

    def __init__(self, pipes: RankPipes, process: WorkerProcess):
        self.pipes = pipes
        self.process = process
        self.number = pipes.rank
        self.frames = wire.FrameReader()
        self.splitters = {"stdout": LineSplitter(), "stderr": LineSplitter()}
        self.tail: deque[str] = deque(maxlen=LOG_TAIL)
        self.has_result = False
        self.result: Any = None
        self.failure: RankFailure | None = None  # its failed_at orders a launch's failures
        self.finished = False
        self.busy = True  # running its function or a call (a warm rank between calls is not)
        self.imported: list[str] = []  # the installed libraries it imported, told as it goes
        self.collectives: dict[str, tuple[int, int]] = {}  # {kind: (entered, left)}, told with its stacks


_LINE_END = re.compile(rb"\r\n|\n|\r")


class LineSplitter:
    """Feed it bytes as they come; get back whole lines and the last carriage-return line.

    A line ended by ``\\r`` alone is a progress bar redrawing itself: it is returned separately
    as ``transient`` so a display can overwrite it instead of keeping every redraw.
    """

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> tuple[list[str], str | None]:
        data = self._pending + data
        if b"\r" not in data:
            # The common case, without a per-line Python loop (chatty ranks send 100k+ lines):
            # UTF-8 never has a b"\n" inside a character, so decoding the whole then splitting
            # gives the same lines.
            end = data.rfind(b"\n")
            if end < 0:
                self._pending = data
                return [], None
            self._pending = data[end + 1 :]
            return data[:end].decode("utf-8", "replace").split("\n"), None
        lines: list[str] = []
        transient = None
        start = 0
        for match in _LINE_END.finditer(data):
            end = match.end()
            if match.group() == b"\r" and end == len(data):
                break  # might be the first half of \r\n: wait for the next chunk
            text = data[start : match.start()].decode("utf-8", "replace")
            if match.group() == b"\r":
                transient = text or transient  # "\r" right after a line end redraws nothing yet
            else:
                lines.append(text)
                transient = None
            start = end
        self._pending = data[start:]
        return lines, transient

    def flush(self) -> list[str]:
        """At EOF: whatever is left, as a last line (a rank need not end with a newline)."""
        rest, self._pending = self._pending, b""
        text = rest.rstrip(b"\r").decode("utf-8", "replace")
        return [text] if text else []
