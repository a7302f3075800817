"""What the supervisor knows about one rank while it watches it."""

from __future__ import annotations

from collections import deque
from typing import Any

from nblaunch import wire
from nblaunch.launch.errors import RankFailure
from nblaunch.launch.starting.processes import RankPipes, WorkerProcess
from nblaunch.launch.supervising.lines import LineSplitter

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
        self.failure: RankFailure | None = None
        self.failed_at: float | None = None
        self.report_complete = True  # False between a failure's first frame and its traceback
        self.finished = False
