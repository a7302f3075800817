"""How a launch's processes start: one :class:`Starter` per way (``STARTERS`` in the package).

A :class:`~nblaunch.launch.local_cluster.LocalCluster` takes the starter its plan names. ``prepare``
runs once per launch, on the caller's thread: the process the ranks will be forked from imports
what they will import (``preload``), and the starter says so in a few words for the launch's
line. ``start`` starts every process of one attempt; ``release`` frees what it held for them.

Example::

    starter = ForkStarter()
    said = starter.prepare(plan)               # "sklearn, torch imported here first (1.9 s)"
    workers = starter.start(plan, environ)     # one WorkerProcess per rank (XLA: one host)
    ...
    starter.release()                          # after the attempt, whatever happened
"""

from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod
from typing import Callable

from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes.processes import WorkerProcess, kill_and_reap
from nblaunch.worker.bootstrap import WorkerSettings


class Starter(ABC):
    """One way of starting the processes of a launch."""

    def prepare(self, plan: LaunchPlan) -> str:
        """Once per launch, on the caller's thread, before anything is shown: ready where the
        ranks come from; what was done there, in words for the launch's line ("" if nothing)."""
        return ""

    @abstractmethod
    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        """Start every process of one attempt, each running ``plan.request``'s function;
        ``environ`` is added to each rank's variables. If starting fails midway, what was started
        is stopped before the error is raised."""

    def release(self) -> None:
        """Free what ``start`` held for the ranks (a spawn's shared memory); after every attempt."""


def rank_settings(plan: LaunchPlan, environ: dict[str, str], forget: tuple[str, ...] = ()) -> list[WorkerSettings]:
    """What each local rank of ``plan`` is told, in order; ``environ`` is added to its variables."""
    return [
        WorkerSettings(
            rank=local_rank,
            environ=dict(environ, **plan.rank_environ(local_rank)),
            threads=plan.threads,
            parent_pid=os.getpid(),
            sys_path=list(sys.path),
            forget=forget,
        )
        for local_rank in range(plan.num_processes)
    ]


def start_each_rank(plan: LaunchPlan, environ: dict[str, str],
                    start_one: Callable[[WorkerSettings], WorkerProcess]) -> list[WorkerProcess]:
    """``start_one`` for every local rank of ``plan``, in order; none is left if one fails."""
    workers: list[WorkerProcess] = []
    for settings in rank_settings(plan, environ):
        try:
            workers.append(start_one(settings))
        except BaseException:
            kill_and_reap(workers)
            raise
    return workers
