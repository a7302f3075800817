"""The XLA host: one forked process runs torch_xla's ``xmp.spawn``, whose processes (one per
chip) run one thread per device; every device is a rank with pipes of its own."""

from __future__ import annotations

import os

import cloudpickle

from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes.processes import Pipes, WorkerProcess, fork_process
from nblaunch.launch.starting.base import Starter
from nblaunch.launch.starting import rank_imports
from nblaunch.launch.starting.preload import Preloaded, preload_here, preloading
from nblaunch.worker.xla_ranks import RankEnds, run_host

# About 3 s per launch otherwise; importing does not start the XLA runtime.
XLA_LAUNCHER = ("torch_xla.distributed.xla_multiprocessing", ())


class XlaHostStarter(Starter):
    """One host process for every rank of the launch."""

    def __init__(self) -> None:
        self._preloaded = Preloaded({})

    def prepare(self, plan: LaunchPlan) -> str:
        # The host is forked from here: it and its ranks begin with what is imported now.
        wanted = rank_imports.wanted(plan.request.function, plan.request.args) if preloading() else []
        self._preloaded = preload_here().preload([XLA_LAUNCHER, *wanted])
        return self._preloaded.said

    def start(self, plan: LaunchPlan, environ: dict[str, str]) -> list[WorkerProcess]:
        # torch_xla pickles the function for its process pool (even with fork): cloudpickle it
        # first, so a function defined in a notebook cell travels by value.
        packed = cloudpickle.dumps((plan.request.function, plan.request.args))
        assert plan.xla_environ is not None
        environ = {**self._preloaded.environ, **environ, **plan.xla_environ}
        return [start_xla_host(environ, packed, plan.num_processes)]


def start_xla_host(environ: dict[str, str], packed_function: bytes, num_ranks: int) -> WorkerProcess:
    """Fork the process that runs ``xmp.spawn``; it and its children host every rank. This
    process imported torch_xla first (``prepare``), so the fork inherits it."""
    ranks = {rank: Pipes.open() for rank in range(num_ranks)}
    ends = {rank: RankEnds(p.stdout[1], p.stderr[1], p.events[1], p.control[0]) for rank, p in ranks.items()}
    parent = os.getpid()
    return fork_process(ranks, lambda: run_host(environ, parent, packed_function, ends))
