"""What a warm start holds now, for the user: ``nblaunch.warm_start()``.

Example (in a notebook, after a GPU launch from the launch server)::

    >>> nblaunch.warm_start()
    Warm start (NBLAUNCH_PRELOAD=1, NBLAUNCH_STANDBY=auto):
      rank 0 waits on GPU 0 since 14:02:11 (CUDA ready in 0.61 s, 512 MiB), pid 4242
      loaded ahead by the launch server: torch._dynamo, nblaunch.training, sklearn (+3 more)
    >>> nblaunch.warm_start().release()     # the GPU's memory back, now
    1
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from nblaunch.contract.variables import PRELOAD, STANDBY
from nblaunch.launch.ahead import early_start, standby
from nblaunch.launch.ahead.caller import caller
from nblaunch.launch.ahead.kernel_preload import kernel_preload
from nblaunch.launch.ahead.launch_server import running_server
from nblaunch.launch.ahead.ledger import ledger

_NAMED = 8  # packages named before "(+N more)"


@dataclasses.dataclass(frozen=True)
class WaitingRank:
    """One rank on standby."""

    rank: int
    device: str  # "cpu", or the GPU's index
    pid: int
    since: float  # time.time()
    ready_s: float | None  # how long readying its device took
    held_mib: int | None  # GPU memory it holds (None: not known, or on the CPU)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """What the next launch's ranks will find ready (see the module)."""

    waiting: tuple[WaitingRank, ...]  # ranks on standby
    server_loaded: tuple[str, ...]  # packages a generation of the launch server imported
    kernel_loaded: tuple[str, ...]  # packages this process imported for its forked ranks
    refused: dict[str, str]  # packages never loaded ahead, and why
    standby_setting: str
    preload_setting: str
    standby_off: str | None  # why no rank waits any more in this process
    last_release: str | None  # why the last ranks on standby were let go
    server_ready_s: dict[str, float | None] = dataclasses.field(default_factory=dict)  # its processes' imports
    said: dict[str, str] = dataclasses.field(default_factory=dict)  # what an import here wrote, by package

    def release(self) -> int:
        """Let every rank on standby go now (its GPU memory freed); how many there were. The
        next launch from the launch server starts them again: ``NBLAUNCH_STANDBY=0`` for never."""
        server = running_server()
        return 0 if server is None else server.release_standby("released by nblaunch.warm_start().release()")

    def __repr__(self) -> str:
        lines = [f"Warm start ({PRELOAD}={self.preload_setting}, {STANDBY}={self.standby_setting}):"]
        for r in self.waiting:
            where = "the CPU" if r.device == "cpu" else f"GPU {r.device}"
            facts = [f"CUDA ready in {r.ready_s:.2f} s" if r.ready_s is not None and r.device != "cpu" else None,
                     f"{r.held_mib} MiB" if r.held_mib is not None else None]
            said = ", ".join(f for f in facts if f)
            lines.append(f"  rank {r.rank} waits on {where} since {time.strftime('%H:%M:%S', time.localtime(r.since))}"
                         f"{f' ({said})' if said else ''}, pid {r.pid}")
        if not self.waiting:
            lines.append(f"  no rank waits on standby{f': {self.standby_off or self.last_release}' if self.standby_off or self.last_release else ''}")
        for where, packages in (("the launch server", self.server_loaded), ("this process", self.kernel_loaded)):
            if packages:
                more = f" (+{len(packages) - _NAMED} more)" if len(packages) > _NAMED else ""
                lines.append(f"  loaded ahead by {where}: {', '.join(packages[:_NAMED])}{more}")
        if self.server_ready_s:
            lines.append("  launch server: " + ", ".join(
                f"{name} {'importing' if s is None else f'ready in {s:.1f} s'}" for name, s in self.server_ready_s.items()))
        for package, why in self.refused.items():
            lines.append(f"  not loaded ahead: {package} ({why})")
        for package, text in self.said.items():
            lines.append(f"  {package} wrote as this process imported it: " + text.strip().replace("\n", "\n    "))
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # noqa: ANN001  IPython's
        printer.text(repr(self))


def warm_start(wait: float | None = 0) -> WarmStart:
    """What the next launch's ranks will find ready: ranks waiting on standby (their GPU, memory,
    since when), the packages loaded ahead for them, those that could not be; ``.release()``
    lets the ranks on standby go. ``wait``: seconds to wait first for the warm-up under way to
    finish (None: as long as it takes). See README's "A warm start" for the settings.

    Example::

        >>> nblaunch.warm_start(wait=60).waiting   # (WaitingRank(rank=0, device='0', ...),)
        >>> nblaunch.warm_start().release()        # 1
    """
    if wait != 0:
        started = time.monotonic()
        early_start.wait_started(wait)
        with caller().parked():  # this process imports ahead meanwhile, even inside a cell
            kernel_preload().wait_loaded(wait)
        server = running_server()
        if server is not None:
            server.wait_warm(None if wait is None else max(0.0, wait - (time.monotonic() - started)))
    server = running_server()
    waiting = []
    for r in [] if server is None else server.waiting():
        facts = r.facts or {}
        waiting.append(WaitingRank(r.rank, r.device, r.worker.pid, r.since, facts.get("seconds"), facts.get("held_mib")))
    server_loaded: list[str] = []
    ready_s: dict[str, float | None] = {}
    if server is not None:
        trusted, full = server.generations()
        for name, link in (("base", server.base), ("trusted generation", trusted and trusted.link),
                           ("full generation", full and full.link)):
            if link is not None and link.alive:
                ready_s[name] = None if link.ready_at is None else link.ready_at - link.started_at
        for generation in (trusted, full):
            if generation is not None and generation.link.ready:
                server_loaded += [p for p, verdict in generation.link.verdicts.items()
                                  if verdict == "ok" and _shown(p)]
    return WarmStart(
        waiting=tuple(waiting),
        server_loaded=tuple(dict.fromkeys(server_loaded)),
        kernel_loaded=tuple(p for p in kernel_preload().loaded() if _shown(p)),
        refused=ledger().refused(),
        standby_setting=standby.mode(),
        preload_setting=os.environ.get(PRELOAD, "1"),
        standby_off=None if server is None else server.standby_off,
        last_release=None if server is None else server.last_release,
        server_ready_s=ready_s,
        said=kernel_preload().said(),
    )


def _shown(package: str) -> bool:
    """A library a user would name: not the standard library's, nor a private helper's."""
    return package not in sys.stdlib_module_names and not package.startswith("_")
