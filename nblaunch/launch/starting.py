"""Starting a launch's worker processes (and stopping them again if starting fails midway).

``environ_for_ranks`` runs on the caller's thread, before any launch thread exists: the imports
it does for the ranks change ``os.environ`` for a moment, which a background thread must never do.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import cloudpickle

from nblaunch.launch.payload import Payload
from nblaunch.launch.plan import LaunchPlan
from nblaunch.launch.preimport import import_for_ranks
from nblaunch.launch.workers import WorkerProcess, start_forked, start_spawned, start_xla_host
from nblaunch.worker.bootstrap import WorkerSettings

# Building the first optimizer (or DDP) imports torch._dynamo: ~1 s of CPU in every process that
# does it, 2-3 s when two ranks do it at once on 2 cores, at every launch. Imported here once,
# every forked rank inherits it. Only when a training library is loaded (the launch will train),
# so a launch that does not train pays nothing.
_TRAINING_MODULES = ("nblaunch.training", "accelerate")


def environ_for_ranks(plan: LaunchPlan) -> dict[str, str]:
    """Import here, once per kernel, what forked ranks would each import; return the variables
    those imports set, for the ranks (the kernel's environment is put back)."""
    if plan.start_method == "xla":
        # About 3 s per launch otherwise; importing does not start the XLA runtime.
        return import_for_ranks("torch_xla.distributed.xla_multiprocessing")
    if plan.start_method != "fork" or "torch" not in sys.modules:
        return {}
    if not any(name in sys.modules for name in _TRAINING_MODULES):
        return {}
    try:
        return import_for_ranks("torch._dynamo")
    except Exception:  # an optimisation only: the ranks import it themselves if it fails here
        return {}


def start_workers(plan: LaunchPlan, function: Callable, args: tuple, inherited: dict[str, str],
                  payload: Payload | None) -> list[WorkerProcess]:
    """Start every process of the launch; ``inherited`` is ``environ_for_ranks(plan)``, and
    ``payload`` is ``package((function, args))`` for a spawn launch (None otherwise)."""
    if plan.start_method == "xla":
        # torch_xla pickles the function for its process pool (even with fork): cloudpickle it
        # first, so a function defined in a notebook cell travels by value.
        packed = cloudpickle.dumps((function, args))
        return [start_xla_host(dict(inherited, **plan.xla_environ), packed, plan.num_processes)]
    workers: list[WorkerProcess] = []
    for local_rank in range(plan.num_processes):
        settings = WorkerSettings(
            rank=local_rank,
            environ=dict(inherited, **plan.rank_environ(local_rank)),
            threads=plan.threads,
            parent_pid=os.getpid(),
            sys_path=list(sys.path),
        )
        try:
            if payload is None:
                workers.append(start_forked(settings, function, args))
            else:
                workers.append(start_spawned(settings, payload, dict(os.environ, **settings.environ)))
        except BaseException:
            kill_and_reap(workers)
            raise
    return workers


def kill_and_reap(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        worker.kill()
        worker.wait()
        worker.close()
