"""Fork: every rank begins as a copy of the launching process (the quickest start, the default
where it is safe). The child shares the parent's memory, so data sets are not copied."""

from __future__ import annotations

import sys
from typing import Callable

from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.starting.base import Starter, start_each_rank
from nblaunch.launch.starting.processes import Pipes, WorkerProcess, fork_process
from nblaunch.preimport import import_for_ranks
from nblaunch.worker.bootstrap import WorkerSettings, run_forked

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

    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        request = plan.request
        # A fork copies what the kernel's streams still buffer (ipykernel sends stdout and stderr
        # on a timer, and takes a forked child's flush as output of its own): each rank would
        # show the kernel's last unsent line in the cell once more.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001  a stream that cannot flush has nothing to copy
                pass
        return start_each_rank(plan, environ, lambda settings: fork_rank(settings, request.function, request.args))


def fork_rank(settings: WorkerSettings, function: Callable, args: tuple) -> WorkerProcess:
    """Fork one rank that runs ``function(*args)``."""
    pipes = Pipes.open()
    return fork_process(
        {settings.rank: pipes},
        lambda: run_forked(
            settings,
            function,
            args,
            stdout_fd=pipes.stdout[1],
            stderr_fd=pipes.stderr[1],
            event_fd=pipes.events[1],
            control_fd=pipes.control[0],
        ),
    )
