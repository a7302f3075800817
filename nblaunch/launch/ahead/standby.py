"""Ranks started ahead of the next launch, waiting on standby (``server/standby_rank``), and
what the user sees of them.

After a launch whose ranks came from the launch server, one rank per GPU it used is started
again (``LaunchServer`` decides when, from which process): forked, its CUDA context and
libraries ready, waiting for the next launch of the same shape (as many ranks, the same devices,
this process's environment and folder as they are now, nothing they found loaded installed anew
since). That launch claims them (``CLAIM`` on each control socket, answered before anything else
is sent) instead of starting ranks; a launch of another shape releases them first and waits
until they are gone, their GPU memory with them.
``NBLAUNCH_STANDBY``: "auto" (the default: GPU launches), "0" (never), "always" (CPU ranks too).

Example::

    group = StandbyGroup.start(shape, link, names, stamps)   # after a launch: ranks forked, readying
    group.claim()                                 # the next launch: {local rank: WorkerProcess}
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
from nblaunch.contract import variables as v
from nblaunch.contract.variables import STANDBY
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes.processes import Pipes, WorkerProcess, handle_for, kill_and_reap
from nblaunch.launch.ahead.ledger import Stamp
from nblaunch.launch.ahead.server_link import ServerLink

CLAIM_WAIT_S = 30.0  # a rank answers once its GPU is ready and its import under way done (seconds)
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
    node_rank: int = 0
    num_nodes: int = 1

    @classmethod
    def of(cls, plan: LaunchPlan, environ: dict[str, str], cwd: str) -> "Shape":
        return cls(plan.num_processes, plan.device_kind, tuple(sorted(environ.items())), cwd, plan.node_rank,
                   plan.num_nodes)

    def rank_environ(self, local_rank: int) -> dict[str, str]:
        """The variables naming rank ``local_rank`` that a launch of this shape will set, for the
        imports it makes while it waits (a library may read them at import)."""
        rank, world = self.node_rank * self.num_processes + local_rank, self.num_nodes * self.num_processes
        return {v.RANK: str(rank), v.LOCAL_RANK: str(local_rank), v.WORLD_SIZE: str(world),
                v.LOCAL_WORLD_SIZE: str(self.num_processes), v.NODE_RANK: str(self.node_rank),
                v.GROUP_RANK: str(self.node_rank)}

    def differs(self, other: "Shape") -> str | None:
        """How ``other`` differs from this, in words; None if it does not."""
        if (self.num_processes, self.device_kind, self.node_rank, self.num_nodes) != (
                other.num_processes, other.device_kind, other.node_rank, other.num_nodes):
            return f"the launch asks for {other.num_processes} {other.device_kind.upper()} rank(s)"
        if self.environ != other.environ:
            names = sorted(dict(self.environ).items() ^ dict(other.environ).items())
            return f"the environment changed ({', '.join(sorted({n for n, _ in names})[:3])})"
        if self.cwd != other.cwd:
            return "the folder changed"
        return None


@dataclasses.dataclass(eq=False)
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
    """The ranks waiting for one shape of launch, forked by one process of the server. One
    thread at a time reads their reports (a claim hands them to a launch, whose supervisor reads
    on from there)."""

    def __init__(self, shape: Shape, source: ServerLink, ranks: list[StandbyRank],
                 stamps: dict[str, Stamp | None]) -> None:
        self.shape, self.source, self.ranks, self.stamps = shape, source, ranks, stamps
        self.left: list[str] = []  # why each rank that left by itself did
        self._lock = threading.Lock()

    @classmethod
    def start(cls, shape: Shape, source: ServerLink, names: list[str],
              stamps: dict[str, Stamp | None]) -> "StandbyGroup":
        """Fork one rank per local rank of ``shape`` from ``source`` (GPU r for rank r), each to
        import ``names`` while it waits; ``stamps``: the files of what it finds loaded."""
        ranks = []
        try:
            for rank in range(shape.num_processes):
                device = str(rank) if shape.device_kind == "cuda" else "cpu"
                pipes = Pipes.open()
                try:
                    pid = source.start_rank(pipes, dict(shape.environ), shape.cwd,
                                            standby=(device, names, shape.rank_environ(rank)))
                except BaseException:
                    pipes.close()
                    raise
                worker = handle_for(pid, {rank: pipes}, reaper=ServerChild(source, pid))
                ranks.append(StandbyRank(rank, device, worker, time.time()))
        except BaseException:
            kill_and_reap([r.worker for r in ranks])
            raise
        return cls(shape, source, ranks, stamps)

    def wait_ready(self, timeout: float) -> None:
        """Wait until every rank said it is ready, or left, or ended, or was claimed
        (``timeout`` at most)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                for standby in self.ranks:
                    standby.news()
                pending = [r for r in self.ranks if r.facts is None and r.left is None and r.alive]
                fds = [r.worker.ranks[0].event_fd for r in pending]
                fds += [r.worker.exit_fd for r in pending if r.worker.exit_fd is not None]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return
            select.select(fds, [], [], min(left, 1.0))  # only looks: whoever holds the lock reads

    def claim(self) -> dict[int, WorkerProcess]:
        """Every rank that still waits, for a launch of this group's shape: theirs now. Each is
        told at once; each answers once its device is ready and its import under way is done.
        A rank that left, died, or does not answer in time is not among them (the launch starts
        one afresh)."""
        with self._lock:
            ranks, self.ranks = self.ranks, []
            for standby in ranks:
                standby.news()
            asked = [r for r in ranks if r.alive and r.left is None and _tell(r.worker)]
            answered = _answers(asked, time.monotonic() + CLAIM_WAIT_S)
            claimed = {}
            for standby in ranks:
                if standby in answered:
                    where = "the CPU" if standby.device == "cpu" else f"GPU {standby.device}, CUDA ready"
                    since = time.strftime("%H:%M:%S", time.localtime(standby.since))
                    standby.worker.began = f"warm: waited on {where} since {since}"
                    claimed[standby.rank] = standby.worker
                else:
                    kill_and_reap([standby.worker])
            return claimed

    def release(self) -> None:
        """Let every rank go, and wait until each is gone (its GPU memory freed)."""
        with self._lock:
            ranks, self.ranks = self.ranks, []
            for standby in ranks:
                standby.news()
                if standby.worker.poll() is None:  # never a pid its server reaped already
                    standby.worker.kill()
            deadline = time.monotonic() + GONE_WAIT_S
            for standby in ranks:
                if standby.worker.returncode is None:
                    standby.worker.returncode = self.source.exit_code(
                        standby.worker.pid, wait=True, timeout=max(0.0, deadline - time.monotonic()))
                standby.worker.close()

    def live(self) -> list[StandbyRank]:
        """The ranks still waiting (those that left are let go, and why kept in ``left``)."""
        with self._lock:
            for standby in list(self.ranks):
                standby.news()
                if not standby.alive:
                    standby.news()  # what it said just before it went
                    self.left.append(f"rank {standby.rank} left: {standby.left or 'it ended'}")
                    standby.worker.close()
                    self.ranks.remove(standby)
            return list(self.ranks)


def _tell(worker: WorkerProcess) -> bool:
    """Tell a waiting rank a launch takes it; False if it is gone."""
    try:
        wire.write_frame(worker.ranks[0].control_fd, wire.CLAIM)
        return True
    except OSError:
        return False


def _answers(asked: list[StandbyRank], deadline: float) -> set[StandbyRank]:
    """The ranks of ``asked`` that agreed by ``deadline`` (after that they never leave on their own)."""
    waiting = {r.worker.ranks[0].control_fd: r for r in asked}
    agreed: set[StandbyRank] = set()
    while waiting and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(list(waiting), [], [], left)
        for fd in ready:
            standby = waiting.pop(fd)
            try:
                if os.read(fd, wire.HEADER.size) == wire.encode(wire.CLAIM):
                    agreed.add(standby)
            except OSError:
                pass
    return agreed


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

    def ended_because(self) -> str | None:
        if self._link.died_with_it(self.pid):
            return (f"its launch server ({self._link.name}, pid {self._link.pid}) died, and the ranks it had "
                    "started with it; the next launch starts a new one")
        return None


def watch_cuda_here(release: Callable[..., object], here: int) -> bool:
    """Ranks waiting must not take GPU memory this process (pid ``here``) wants: ``release(why)``
    them when torch starts CUDA here (before it allocates anything), and ``release(why, True)``
    (for good) after an out-of-memory error here. (They also leave by themselves when any process,
    this one included, allocates on their GPU: ``server/standby_rank``.) A forked child of this
    process keeps torch's hooks, not the ranks: it does nothing. True once it watches."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False

    def out_of_memory(*_: object) -> None:  # inside the allocator: never wait there
        if os.getpid() == here:
            threading.Thread(target=release, args=("this process ran out of GPU memory", True), daemon=True).start()

    def watch_memory() -> None:
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            attach(out_of_memory)

    def started() -> None:  # torch runs it inside its lazy CUDA start, on the user's thread
        if os.getpid() == here:
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
