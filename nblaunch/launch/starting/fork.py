"""Fork: every rank begins as a copy of the launching process (the quickest start, the default
where it is safe). The child shares the parent's memory, so data sets are not copied, and every
module the parent imported: what the ranks will import is imported here first (``preload``), once
instead of once per rank, so this launch's ranks and every later one's begin with it.

Where a GPU is visible and CUDA is not started here, only torch's and nblaunch's own modules are
imported for the ranks (``IMPORTED_WHERE_A_GPU_IS``): any other library could start CUDA at
import, and this process could then no longer fork ranks that use it."""

from __future__ import annotations

from typing import Callable, NoReturn

from nblaunch.launch.planning import devices
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes.processes import Pipes, WorkerProcess, fork_processes
from nblaunch.launch.starting import rank_imports
from nblaunch.launch.starting.base import Starter, rank_settings
from nblaunch.launch.starting.preload import Preloaded, preload_here, preloading
from nblaunch.worker.bootstrap import WorkerSettings, run_forked
from nblaunch.worker.streams import std_stream_handlers

IMPORTED_WHERE_A_GPU_IS = frozenset({rank_imports.TRAINS, "nblaunch.training"})


class ForkStarter(Starter):
    """One forked process per rank."""

    def __init__(self) -> None:
        self._preloaded = Preloaded({})

    def prepare(self, plan: LaunchPlan) -> str:
        request = plan.request
        if not preloading():
            return ""
        only = IMPORTED_WHERE_A_GPU_IS if devices.cuda_device_count() else None
        self._preloaded = preload_here().preload(rank_imports.wanted(request.function, request.args), only)
        return self._preloaded.said

    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        request, preloaded = plan.request, self._preloaded
        each = rank_settings(plan, dict(preloaded.environ, **environ), preloaded.forget)
        return fork_ranks(each, request.function, request.args)


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
