"""What the next launch's ranks will find ready where they come from: ``nblaunch.preloaded()``.

Example (in a notebook, after a launch whose function imports scikit-learn)::

    >>> nblaunch.preloaded()
    Ready for the next launch's ranks (NBLAUNCH_PRELOAD=1):
      imported in this process: sklearn, torch._dynamo
      no launch server runs
    >>> nblaunch.preloaded().release()   # the launch server (and kept Ray nodes) let go: 1
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable

from nblaunch.contract.variables import PRELOAD
from nblaunch.launch.starting.preload import preload_here
from nblaunch.launch.starting.server import running_server, servers
from nblaunch.launch.starting.server_starter import server_refusals

_NAMED = 8  # packages named before "(+N more)"


@dataclasses.dataclass(frozen=True)
class PreloadReport:
    """What is imported for the ranks, where (see the module)."""

    here: tuple[str, ...]  # packages this process imported for the ranks it forks
    server: tuple[str, ...]  # packages the launch server imported for its ranks
    server_pid: int | None  # the launch server's process, if one runs
    refused: dict[str, str]  # packages left to the ranks themselves, and why
    setting: str  # NBLAUNCH_PRELOAD
    server_replaced: str | None = None  # why the last launch server was replaced
    ray_nodes: tuple[str, ...] = ()  # the Ray nodes kept for the next launch, in words
    releasers: tuple[Callable[[], int], ...] = dataclasses.field(default=(), repr=False, compare=False)

    def release(self) -> int:
        """Let go what is kept for the next launch: the launch server, the Ray nodes (their
        agents and the CPUs and GPUs they hold); how many processes that was. The next launch
        starts them again."""
        return sum(release() for release in self.releasers)

    def __repr__(self) -> str:
        lines = [f"Ready for the next launch's ranks ({PRELOAD}={self.setting}):"]
        lines.append(f"  imported in this process: {_names(self.here) or 'nothing yet'}")
        if self.server_pid is None:
            lines.append("  no launch server runs")
        else:
            lines.append(f"  imported in the launch server (pid {self.server_pid}): {_names(self.server) or 'torch'}")
        if self.server_replaced:
            lines.append(f"  the last launch server was replaced: {self.server_replaced}")
        lines += [f"  kept on Ray: {nodes}" for nodes in self.ray_nodes]
        for package, why in self.refused.items():
            lines.append(f"  left to the ranks: {package} ({why})")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # noqa: ANN001  IPython's
        printer.text(repr(self))


def preloaded_here() -> PreloadReport:
    """What the next launch's ranks will find imported where they are forked from on this
    machine (this process, the launch server), and what is left to them and why
    (``nblaunch.preloaded()`` adds a cluster's kept nodes)."""
    server = running_server()
    here = preload_here()
    return PreloadReport(
        here=tuple(p for p in here.brought() if _shown(p)),
        server=tuple(p for p in (server.loaded if server is not None else {}) if _shown(p)),
        server_pid=None if server is None else server.pid,
        refused={**here.refused, **server_refusals().why},
        setting=os.environ.get(PRELOAD, "1"),
        server_replaced=servers().replaced_because,
        releasers=(_release_server,),
    )


def _release_server() -> int:
    server = running_server()
    if server is None:
        return 0
    servers().current = None
    server.close()
    return 1


def _names(packages: tuple[str, ...]) -> str:
    more = f" (+{len(packages) - _NAMED} more)" if len(packages) > _NAMED else ""
    return ", ".join(packages[:_NAMED]) + more


def _shown(package: str) -> bool:
    """A library a user would name: not the standard library's, nor a private helper's."""
    return package not in sys.stdlib_module_names and not package.startswith("_")
