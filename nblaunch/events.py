"""The event stream from a launch to whatever displays it.

The supervisor turns everything the workers do (lines of output, progress, metrics, results,
failures, stacks) into these events and hands them to a display. A display only needs
``on_event(event)`` and ``close()``; it never learns where the events came from, so the text
printer, the notebook widget and a test recorder are interchangeable.

Events are plain frozen dataclasses: cheap to create, safe to keep, easy to assert on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol


class RankState(str, enum.Enum):
    """Life cycle of one rank as the launcher sees it."""

    STARTING = "starting"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"  # stopped by the launcher (another rank failed, interrupt, timeout)


@dataclass(frozen=True)
class LaunchStarted:
    """The plan of a launch, sent once before any worker starts."""

    function_name: str
    num_processes: int
    world_size: int
    node_rank: int
    start_method: str
    start_reason: str
    master_addr: str
    master_port: int
    devices: str
    log_dir: str | None = None
    meeting_point: str = ""  # where the ranks meet when it is not master_addr:master_port

    @property
    def rendezvous(self) -> str:
        """Where the ranks meet: ``host:port`` unless the launch named another meeting point."""
        return self.meeting_point or f"{self.master_addr}:{self.master_port}"


@dataclass(frozen=True)
class RankStarted:
    rank: int  # local rank on this node
    pid: int


@dataclass(frozen=True)
class Output:
    """Whole lines a rank wrote, in order, without their line endings.

    Lines come in batches (all that one read from the rank's pipe held) because a rank can
    print 100k lines and an event per line would cost more than the printing.
    ``stream`` is "stdout" or "stderr". ``transient`` marks a batch of one line that ended in a
    carriage return (a progress bar redrawing itself): the next line replaces it.
    """

    rank: int
    stream: str
    lines: tuple[str, ...]
    transient: bool = False


@dataclass(frozen=True)
class Progress:
    """Progress of one rank's loop (from tqdm in the worker or ``nblaunch.progress``).

    ``auto`` marks a bar nblaunch draws by itself (a prepared DataLoader's epoch); displays
    hide those on a rank whose code draws bars of its own.
    """

    rank: int
    bar_id: int
    n: float
    total: float | None
    desc: str = ""
    closed: bool = False
    auto: bool = False


@dataclass(frozen=True)
class Metrics:
    """Values a rank logged with ``Accelerator.log`` (or ``nblaunch.worker.channel.log_metrics``)."""

    rank: int
    values: dict[str, float]
    step: int | None


@dataclass(frozen=True)
class StepTimes:
    """Training steps a rank measured, split into their parts (``nblaunch.step_split.book.StepRecord``
    tuples); ``note``: what it could not measure, and why ("" when nothing)."""

    rank: int
    steps: tuple[tuple, ...]
    note: str = ""


@dataclass(frozen=True)
class CallFinished:
    """A warm rank finished one call (see nblaunch.warm) and sent back its value."""

    rank: int
    call_id: int
    result: Any


@dataclass(frozen=True)
class CallFailed:
    """A warm rank's call raised (``failure``: a ``RankFailure``); the rank serves on."""

    rank: int
    call_id: int
    failure: Any


@dataclass(frozen=True)
class CallSteps:
    """How many step boundaries a warm rank had passed in its call when an interrupt asked."""

    rank: int
    call_id: int
    steps: int


@dataclass(frozen=True)
class GroupReleased:
    """A warm rank released its process group's collectives (``why_not``: "" or why it could not)."""

    rank: int
    why_not: str


@dataclass(frozen=True)
class Stalled:
    """No rank made progress for ``silent_s`` seconds: ``verdict`` says which ranks wait in which
    collective and which rank is elsewhere (each rank's stack came as ``Stacks(why="quiet")``).
    Nothing was stopped."""

    silent_s: float
    verdict: str


@dataclass(frozen=True)
class StallCleared:
    """Progress again after a ``Stalled``."""

    after_s: float


@dataclass(frozen=True)
class Stacks:
    """Where every thread of a rank was when the launcher asked.

    ``why`` is "stop" (an interrupt, a timeout or a failure is stopping the launch), "asked"
    (``Launch.stacks()`` or the dashboard's button: the launch goes on) or "quiet" (every live
    rank had been silent for a while: a hang shows where it is without stopping anything).
    """

    rank: int
    text: str
    why: str = "stop"


@dataclass(frozen=True)
class RankDevice:
    """What a rank computes on, said by its ``Accelerator`` when made: ``"cuda:0"``, ``"bf16"``."""

    rank: int
    device: str
    precision: str


@dataclass(frozen=True)
class RankCompiling:
    """A rank began compiling (``torch.compile``: ``compiling`` True) or ended after ``seconds``."""

    rank: int
    compiling: bool
    seconds: float = 0.0


@dataclass(frozen=True)
class GpuUsage:
    """A rank's GPU as NVML saw it a moment ago: the GPU's index, its utilisation (percent) and
    memory; ``memory_used`` is the rank's own where NVML names its process, else the GPU's."""

    rank: int
    gpu: int
    utilization: int
    memory_used: int
    memory_total: int
    own_memory: bool

    @property
    def line(self) -> str:
        """``GPU 0 · 87% · 12.1/80 GB``, the same in every display."""
        gb = 1 << 30
        return f"GPU {self.gpu} · {self.utilization}% · {self.memory_used / gb:.1f}/{self.memory_total / gb:.0f} GB"


@dataclass(frozen=True)
class RankFinished:
    """A rank reached a final state. ``detail`` says why for failed and stopped ranks."""

    rank: int
    state: RankState
    detail: str = ""
    exitcode: int | None = None


@dataclass(frozen=True)
class RanksPlaced:
    """A cluster placed the ranks: node k (at ``nodes[k]``) runs ranks ``k * ranks_per_node``
    up to ``(k + 1) * ranks_per_node - 1``, and they meet at ``master_addr:master_port``."""

    nodes: tuple[str, ...]
    ranks_per_node: int
    master_addr: str
    master_port: int

    @property
    def line(self) -> str:
        """One line for it, the same in every display."""
        n = self.ranks_per_node
        where = ", ".join(
            f"ranks {k * n}-{k * n + n - 1} on {address}" if n > 1 else f"rank {k} on {address}"
            for k, address in enumerate(self.nodes)
        )
        return f"placed {where}; meeting at {self.master_addr}:{self.master_port}"


@dataclass(frozen=True)
class ClusterWaiting:
    """The cluster has not given the launch its nodes yet: ``line`` says why, in its words
    (a Slurm job pending, its reason and place in the queue). Shown until ``RanksPlaced``."""

    line: str


@dataclass(frozen=True)
class LaunchStopping:
    """The launch is being stopped so that its work is kept: every rank goes on to one common step
    and saves there (``nblaunch.worker.step_stop``). ``line`` says which step, then where it saves."""

    line: str


@dataclass(frozen=True)
class LaunchRestarting:
    """A rank failed and ``max_restarts`` allows another start: every rank was stopped and all
    start again (``restart`` of ``max_restarts``), on a fresh rendezvous."""

    restart: int
    max_restarts: int
    failed_rank: int
    reason: str

    @property
    def line(self) -> str:
        """One line for it, the same in every display and in the logs."""
        return (f"rank {self.failed_rank} failed ({self.reason}); every rank starts again: "
                f"restart {self.restart} of {self.max_restarts}")


@dataclass(frozen=True)
class LaunchFinished:
    """The launch is over: every rank is reaped. ``error`` is what the launcher is about to raise."""

    state: RankState
    elapsed_s: float
    results: list[Any] | None = None
    error: BaseException | None = None
    root_cause_rank: int | None = None
    summary: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    steps: Any = None  # the training steps split (nblaunch.step_split.LaunchSteps), when any was measured


Event = (
    LaunchStarted | ClusterWaiting | RanksPlaced | RankStarted | Output | Progress | Metrics | StepTimes | Stacks | RankFinished
    | LaunchRestarting | LaunchStopping | LaunchFinished | CallFinished | CallFailed | CallSteps | GroupReleased | RankDevice
    | RankCompiling | GpuUsage | Stalled | StallCleared
)


class Display(Protocol):
    """Anything that can show a launch: it receives every event, in order, on one thread."""

    def on_event(self, event: Event) -> None: ...

    def close(self) -> None: ...
