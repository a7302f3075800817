"""Ranks started ahead of the next launch, waiting on standby (``server/standby_rank``), and
what the user sees of them.

After a launch whose ranks came from the launch server, one rank per GPU it used is started
again (``LaunchServer`` decides when, from which process): forked, its CUDA context and
libraries ready, waiting for the next launch of the same shape (as many ranks, the same devices,
this process's environment and folder as they are now). That launch claims them (``CLAIM`` on
each control socket, answered before anything else is sent) instead of starting ranks; a launch
of another shape releases them first and waits until they are gone, their GPU memory with them.
``NBLAUNCH_STANDBY``: "auto" (the default: GPU launches), "0" (never), "always" (CPU ranks too).

Example::

    group = StandbyGroup.start(shape, source)     # after a launch: ranks forked, readying
    group.claim(shape)                            # the next launch: {local rank: WorkerProcess}
    group.release("the launch asked for 4 CPU ranks")
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
import sys
import threading
import time
from typing import Callable

from nblaunch import wire
from nblaunch.contract.variables import STANDBY
from nblaunch.launch.starting.processes import Pipes, WorkerProcess, handle_for, kill_and_reap
from nblaunch.launch.warm_start.server_link import ServerLink
from nblaunch.server.standby_rank import CUT_SHORT

CLAIM_WAIT_S = 60.0  # a rank still readying its GPU answers once ready (seconds at most)
GONE_WAIT_S = 10.0  # released ranks are waited for, so their GPU memory is free before a launch


def mode() -> str:
    """The ``NBLAUNCH_STANDBY`` setting: "auto", "0" or "always"."""
    value = os.environ.get(STANDBY, "auto").strip().lower()
    return {"off": "0", "false": "0", "no": "0", "on": "always", "1": "always"}.get(value, value)


def wanted(device_kind: str) -> bool:
    """Whether ranks of a launch on ``device_kind`` ("cuda", "cpu") should wait on standby."""
    setting = mode()
    return setting == "always" or (setting == "auto" and device_kind == "cuda")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a launch asks of its ranks, as far as ranks started before it can tell."""

    num_processes: int
    device_kind: str
    environ: tuple[tuple[str, str], ...]  # this process's, sorted
    cwd: str

    @classmethod
    def of(cls, num_processes: int, device_kind: str, environ: dict[str, str], cwd: str) -> "Shape":
        return cls(num_processes, device_kind, tuple(sorted(environ.items())), cwd)

    def differs(self, other: "Shape") -> str | None:
        """How ``other`` differs from this, in words; None if it does not."""
        if (self.num_processes, self.device_kind) != (other.num_processes, other.device_kind):
            return f"the launch asks for {other.num_processes} {other.device_kind.upper()} rank(s)"
        if self.environ != other.environ:
            names = sorted(dict(self.environ).items() ^ dict(other.environ).items())
            return f"the environment changed ({', '.join(sorted({n for n, _ in names})[:3])})"
        if self.cwd != other.cwd:
            return "the folder changed"
        return None


@dataclasses.dataclass
class StandbyRank:
    rank: int
    device: str  # "cpu" or the GPU's index
    worker: WorkerProcess
    since: float  # time.time() it was started
    facts: dict | None = None  # its "ready" report: held_mib, seconds
    left: str | None = None  # why it left, if it did
    _reader: wire.FrameReader = dataclasses.field(default_factory=wire.FrameReader)

    def news(self) -> None:
        """Read what it said so far (each report is one atomic write: never half a frame)."""
        try:
            data = os.read(self.worker.ranks[0].event_fd, 1 << 16)
        except (BlockingIOError, OSError):
            data = b""
        for kind, body in self._reader.feed(data):
            if kind == wire.STANDBY:
                what, detail = pickle.loads(body)
                if what == "ready":
                    self.facts = detail
                else:
                    self.left = detail

    @property
    def alive(self) -> bool:
        return self.worker.poll() is None


class StandbyGroup:
    """The ranks waiting for one shape of launch, forked by one process of the server."""

    def __init__(self, shape: Shape, source: ServerLink, ranks: list[StandbyRank]) -> None:
        self.shape, self.source, self.ranks = shape, source, ranks
        self.left: list[str] = []  # why each rank that left by itself did

    @classmethod
    def start(cls, shape: Shape, source: ServerLink, names: list[str]) -> "StandbyGroup":
        """Fork one rank per local rank of ``shape`` from ``source`` (GPU r for rank r), each to
        import ``names`` while it waits."""
        ranks = []
        environ = dict(shape.environ)
        try:
            for rank in range(shape.num_processes):
                device = str(rank) if shape.device_kind == "cuda" else "cpu"
                pipes = Pipes.open()
                try:
                    pid = source.start_rank(pipes, environ, shape.cwd, standby=(device, names))
                except BaseException:
                    pipes.close()
                    raise
                worker = handle_for(pid, {rank: pipes}, reaper=ServerChild(source, pid))
                ranks.append(StandbyRank(rank, device, worker, time.time()))
        except BaseException:
            kill_and_reap([r.worker for r in ranks])
            raise
        return cls(shape, source, ranks)

    def wait_ready(self, timeout: float) -> None:
        """Wait until every rank said it is ready, or left, or ended (``timeout`` at most)."""
        deadline = time.monotonic() + timeout
        while True:
            for standby in self.ranks:
                standby.news()
            pending = [r for r in self.ranks if r.facts is None and r.left is None and r.alive]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return
            select.select([r.worker.ranks[0].event_fd for r in pending] + [r.worker.exit_fd for r in pending
                                                                          if r.worker.exit_fd is not None], [], [],
                          min(left, 1.0))

    def claim(self, shape: Shape) -> dict[int, WorkerProcess]:
        """Every rank that still waits, for a launch of ``shape`` (this group's): theirs now.
        A rank that left, died, or does not answer is not among them (the launch starts one)."""
        claimed = {}
        for standby in self.ranks:
            standby.news()
            if standby.alive and standby.left is None and _claim(standby.worker):
                claimed[standby.rank] = standby.worker
            else:
                kill_and_reap([standby.worker])
        self.ranks = []
        return claimed

    def release(self) -> None:
        """Let every rank go, and wait until each is gone (its GPU memory freed)."""
        for standby in self.ranks:
            standby.news()
            standby.worker.kill()
        deadline = time.monotonic() + GONE_WAIT_S
        for standby in self.ranks:
            if standby.worker.returncode is None:
                standby.worker.returncode = self.source.exit_code(
                    standby.worker.pid, wait=True, timeout=max(0.0, deadline - time.monotonic()))
            standby.worker.close()
        self.ranks = []

    def live(self) -> list[StandbyRank]:
        """The ranks still waiting (those that left are let go, and why kept in ``left``)."""
        for standby in list(self.ranks):
            standby.news()
            if not standby.alive:
                standby.news()  # what it said just before it went
                self.left.append(f"rank {standby.rank} left: {standby.left or 'it ended'}")
                standby.worker.close()
                self.ranks.remove(standby)
        return list(self.ranks)


def _claim(worker: WorkerProcess) -> bool:
    """Tell a waiting rank a launch takes it (cutting short an import under way), and hear it
    agree (after that it never leaves on its own); False if it is gone or does not answer."""
    fd = worker.ranks[0].control_fd
    try:
        wire.write_frame(fd, wire.CLAIM)
        os.kill(worker.pid, CUT_SHORT)
        ready, _, _ = select.select([fd], [], [], CLAIM_WAIT_S)
        return bool(ready) and os.read(fd, wire.HEADER.size) == wire.encode(wire.CLAIM)
    except OSError:
        return False


class ServerChild:
    """How a rank forked by the server ends, for its ``WorkerProcess``: the server reaps it."""

    def __init__(self, link: ServerLink, pid: int) -> None:
        self._link, self.pid = link, pid

    def poll(self) -> int | None:
        return self._link.exit_code(self.pid, wait=False)

    def wait(self) -> int:
        code = self._link.exit_code(self.pid, wait=True)
        assert code is not None
        return code


def watch_cuda_here(release: Callable[..., object]) -> bool:
    """This process's own GPU memory must never be short because ranks wait: ``release(why)``
    them when torch starts CUDA here (before it allocates anything), and ``release(why, True)``
    (for good) after an out-of-memory error here. (They also leave by themselves when any process,
    this one included, allocates on their GPU: ``server/standby_rank``.) True once it watches."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False

    def out_of_memory(*_: object) -> None:  # inside the allocator: never wait there
        threading.Thread(target=release, args=("this process ran out of GPU memory", True), daemon=True).start()

    def watch_memory() -> None:
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            attach(out_of_memory)

    def started() -> None:  # torch runs it inside its lazy CUDA start, on the user's thread
        release("this process started CUDA")
        watch_memory()

    try:
        if torch.cuda.is_initialized():
            watch_memory()
        else:
            torch.cuda._lazy_call(started)
    except Exception:  # noqa: BLE001  a torch without these: the ranks' own watch remains
        return False
    return True
