"""How a launch's processes start: one :class:`Starter` per way (fork, spawn, the XLA host).

A :class:`~nblaunch.launch.homes.LocalHome` picks the starter its plan names and asks it, per
attempt, for every process of the launch. Example::

    starter = ForkStarter()
    environ = starter.environ_for_ranks(plan)          # on the caller's thread, once per launch
    workers = starter.start(plan, environ)             # one WorkerProcess per rank (XLA: one host)
    ...
    starter.release()                                  # after the attempt, whatever happened
    starter.learned(imported)                          # as its ranks tell what they imported
    starter.after(plan)                                # after the attempt, whatever happened
    starter.ready_next()                               # the caller waits until the next one is warm
"""

from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod
from typing import Callable

from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes.processes import WorkerProcess, kill_and_reap
from nblaunch.launch.ahead.ledger import ledger
from nblaunch.worker.bootstrap import WorkerSettings


class Starter(ABC):
    """One way of starting the processes of a launch."""

    def environ_for_ranks(self, plan: LaunchPlan) -> dict[str, str]:
        """Import here, once per launch, what every rank would otherwise import itself; return the
        variables those imports set, for the ranks. Runs on the caller's thread (imports touch
        ``os.environ``, which a launch thread must never do)."""
        return {}

    @abstractmethod
    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        """Start every process of one attempt, each running ``plan.request``'s function;
        ``environ`` is added to each rank's variables. If starting fails midway, what was started
        is stopped before the error is raised."""

    def release(self) -> None:
        """Free what ``start`` held for the ranks (a spawn's shared memory); after every attempt."""

    def learned(self, imported: list[str]) -> None:
        """While the ranks run, on the launch's thread: they imported ``imported`` (to its end);
        the next launch's ranks should find it loaded, so loading it may begin now."""
        ledger().learn(imported)

    def after(self, plan: LaunchPlan) -> None:
        """After an attempt, whatever happened, on the launch's thread: start what readies the
        next launch (it only starts what takes long)."""

    def ready_next(self) -> None:
        """On the caller's thread, parked (``ahead/caller``), after a launch that blocked it:
        wait until where the next launch's ranks come from has what these ranks imported
        (``learned`` and ``after`` began it)."""


def rank_settings(plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerSettings]:
    """What each local rank of ``plan`` is told, in order; ``environ`` is added to its variables."""
    return [
        WorkerSettings(
            rank=local_rank,
            environ=dict(environ, **plan.rank_environ(local_rank)),
            threads=plan.threads,
            parent_pid=os.getpid(),
            sys_path=list(sys.path),
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
