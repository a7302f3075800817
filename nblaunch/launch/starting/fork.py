"""Fork: every rank begins as a copy of the launching process (the quickest start, the default
where it is safe). The child shares the parent's memory, so data sets are not copied, and every
module the parent imported: what earlier ranks imported is imported here between launches
(``launch/ahead/kernel_preload``), so the next ranks begin with it."""

from __future__ import annotations

import sys
from typing import Callable, NoReturn

from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.starting.base import Starter, rank_settings
from nblaunch.launch.processes.processes import Pipes, WorkerProcess, fork_processes
from nblaunch.launch.ahead.kernel_preload import kernel_preload
from nblaunch.launch.ahead.stepping_aside import launches
from nblaunch.preimport import import_for_ranks
from nblaunch.worker.bootstrap import WorkerSettings, run_forked
from nblaunch.worker.streams import std_stream_handlers

# Building the first optimizer (or DDP) imports torch._dynamo: ~1 s of CPU in every process that
# does it, 2-3 s when two ranks do it at once on 2 cores, at every launch. Imported here once,
# every forked rank inherits it. Only when a training library is loaded (the launch will train),
# so a launch that does not train pays nothing.
_TRAINING_MODULES = ("nblaunch.training", "accelerate")


class ForkStarter(Starter):
    """One forked process per rank."""

    def environ_for_ranks(self, plan: LaunchPlan) -> dict[str, str]:
        if "torch" not in sys.modules or not any(name in sys.modules for name in _TRAINING_MODULES):
            return {}
        try:
            return import_for_ranks("torch._dynamo")
        except Exception:  # an optimisation only: the ranks import it themselves if it fails here
            return {}

    def __init__(self) -> None:
        self._alone: bool | None = None  # this attempt runs, and whether alone (ahead/stepping_aside)

    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        request = plan.request
        if self._alone is None:
            self._alone = launches().began(plan)
        with kernel_preload().before_fork() as preloaded:  # between two of its imports
            return fork_ranks(rank_settings(plan, dict(preloaded, **environ)), request.function, request.args)

    def learned(self, imported: list[str]) -> None:
        super().learned(imported)
        kernel_preload().learned()  # while the caller is parked in the launch, on spare cores

    def after(self, plan: LaunchPlan) -> None:
        if self._alone is not None:
            launches().ended(self._alone)
            self._alone = None

    def ready_next(self) -> None:
        kernel_preload().wait_loaded()


def fork_ranks(each: list[WorkerSettings], function: Callable, args: tuple) -> list[WorkerProcess]:
    """Fork one process per rank of ``each``, every one running ``function(*args)``."""
    hosts = []
    handlers = std_stream_handlers()  # here, not in each rank: see the function
    try:
        for settings in each:
            pipes = Pipes.open()
            hosts.append(({settings.rank: pipes}, _forked_rank(settings, pipes, function, args, handlers)))
    except BaseException:  # out of descriptors: give back the pipes already made
        for ranks, _ in hosts:
            for pipes in ranks.values():
                pipes.close()
        raise
    return fork_processes(hosts)


def _forked_rank(settings: WorkerSettings, pipes: Pipes, function: Callable, args: tuple,
                 handlers: list) -> Callable[[], NoReturn]:
    return lambda: run_forked(
        settings,
        function,
        args,
        stdout_fd=pipes.stdout[1],
        stderr_fd=pipes.stderr[1],
        event_fd=pipes.events[1],
        control_fd=pipes.control[0],
        std_handlers=handlers,
    )
