"""This machine as a cluster: ranks are processes here (fork, spawn, or the XLA host), watched by
the :class:`~nblaunch.launch.supervising.supervisor.Supervisor`; a detached launch is kept by a
supervisor process of its own here (:class:`LaunchJob`, in a folder of ``detached/store``).

Example::

    cluster = LocalCluster(LaunchRequest(train, num_processes=2))   # checked and planned
    Launch(cluster).run()                                        # [result of rank 0, rank 1]
    DetachedLaunch(LocalCluster(request).keep())                 # or: outliving the kernel
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
from typing import Any, Callable, ClassVar, Iterator

from nblaunch import proctree
from nblaunch.contract.variables import LAUNCH_ID
from nblaunch.detached import store
from nblaunch.detached.jobs import start_supervisor
from nblaunch.detached.journal import JournalWriter
from nblaunch.detached.kept_launch import KeptInAFolder, KeptLaunch
from nblaunch.events import Event
from nblaunch.launch import registry
from nblaunch.launch.handle import Launch
from nblaunch.launch.planning import pickling, ports
from nblaunch.launch.planning.plan import LaunchPlan, plan_here
from nblaunch.launch.planning.request import LaunchRequest
from nblaunch.launch.cluster_interface import Cluster
from nblaunch.launch.rendezvous import Rendezvous, hosts_store
from nblaunch.launch.starting import rank_imports
from nblaunch.launch.starting.choice import starter_for
from nblaunch.launch.starting.preload import preload_here
from nblaunch.launch.starting.server_starter import server_refusals
from nblaunch.launch.processes.packing import Payload, package
from nblaunch.launch.processes.processes import WorkerProcess, kill_and_reap
from nblaunch.launch.supervising.gpu_usage import GpuSampler
from nblaunch.launch.supervising.supervisor import Supervisor
from nblaunch.worker.calls import serve_calls

class LocalCluster:
    """Ranks as processes of this machine (see the module's docstring)."""

    starts_every_node: ClassVar[bool] = False  # several machines: each runs the same call
    detaches_warm_ranks: ClassVar[bool] = True

    def __init__(self, request: LaunchRequest) -> None:
        self.plan = plan_here(request)
        self._starter = starter_for(self.plan)
        pickling.check_picklable(request.function, request.args)  # names the culprit, before anything starts
        self._launch_id = ""

    def prepare(self, launch_id: str) -> None:
        # On the caller's thread: the imports for the ranks touch os.environ, which a launch
        # thread must never do, and may fail before anything is open or shown. Every process
        # of the launch inherits the tag, whatever session it makes for itself.
        self._launch_id = launch_id
        said = self._starter.prepare(self.plan)
        if said:
            self.plan = dataclasses.replace(self.plan, start_reason=f"{self.plan.start_reason}; {said}")
        if not self.plan.port_pinned and hosts_store(self.plan):
            # The imports may have taken seconds, and a free port chosen before them may have been
            # taken since (seen on a busy machine): a free one is chosen again, just before it is bound.
            self.plan = dataclasses.replace(self.plan, master_port=ports.choose_port(
                self.plan.master_addr, None, hosted_here=True))
        for message in [*registry.stop_stale_ranks(), *preload_here().notices(), *server_refusals().notices()]:
            print(f"nblaunch: {message}", file=sys.stderr)

    def shared_log_root(self) -> str | None:
        return None  # this machine: its temporary folder

    def package(self, value: Any) -> Payload:
        return package(value)  # big tensors and arrays in memfds the ranks map

    @contextlib.contextmanager
    def attempt(self, plan: LaunchPlan, emit: Callable[[Event], None], time_left: float | None,
                log_dir: str) -> Iterator[Supervisor]:
        gpus = GpuSampler.open() if plan.device_kind == "cuda" else None
        try:
            with Rendezvous(plan) as rendezvous, self._ranks(plan, emit, time_left, log_dir, gpus,
                                                             rendezvous) as supervisor:
                yield supervisor
        finally:
            if gpus is not None:
                gpus.close()

    @contextlib.contextmanager
    def _ranks(self, plan: LaunchPlan, emit: Callable[[Event], None], time_left: float | None,
               log_dir: str, gpus: GpuSampler | None, rendezvous: Rendezvous) -> Iterator[Supervisor]:
        record = None
        workers: list[WorkerProcess] = []
        supervisor: Supervisor | None = None
        try:
            workers = self._starter.start(plan, {LAUNCH_ID: self._launch_id})
            rendezvous.serve()  # only now: see launch/rendezvous.py
            record = registry.LaunchRecord(
                launch_id=self._launch_id, launcher_pid=os.getpid(), port=plan.master_port,
                ranks=[(w.pid, proctree.start_ticks(w.pid)) for w in workers], log_dir=log_dir,
                pipes=[end for w in workers for end in w.rank_pipe_ends()],
            )
            record.save()
            # Ranks stop at one common step and save only where all of them are here: across nodes
            # each node's supervisor would pick its own step.
            keeps_work = plan.world_size == plan.num_processes and plan.request.function is not serve_calls
            supervisor = Supervisor(workers, emit, time_left, gpus, plan.request.stall_after,
                                    first_rank=plan.node_rank * plan.num_processes, keeps_work=keeps_work)
            yield supervisor
        except BaseException:
            kill_and_reap(workers)  # normally done by the supervisor; not if starting failed midway
            raise
        finally:
            self._starter.release()
            if workers and not (supervisor is not None and supervisor.ended_cleanly):
                # A rank that was killed could not stop what it had started: find it by its marks.
                if record is not None:
                    record.kill_marked()
                else:  # interrupted before its record was made: the environment mark alone
                    proctree.kill_marked(self._launch_id, set(), None)
            if record is not None:
                record.remove()
            if supervisor is not None:  # the next launch of the function imports them first
                rank_imports.reported(plan.request.function, supervisor.imported)

    def keep(self) -> KeptLaunch:
        request = self.plan.request
        folder = start_supervisor(LaunchJob(dataclasses.replace(request, display="none")), kind="launch",
                                  function=request.function_name, num_processes=self.plan.num_processes)
        return KeptInAFolder(folder)

    @staticmethod
    def kept(kinds: tuple[str, ...]) -> list[KeptLaunch]:
        return [KeptInAFolder(folder) for kind in kinds for folder in store.launch_folders(kind=kind)]


@dataclasses.dataclass
class LaunchJob:
    """A detached launch, as its supervisor runs it: the same ``Launch`` as an attached one,
    planned again there by ``cluster`` (this machine's: the supervisor never touched CUDA, so its
    ranks fork; a Slurm batch job's: its allocation), with the journal as its display. SIGTERM
    cancels it, SIGUSR1 asks every rank for its stack."""

    request: LaunchRequest
    cluster: Callable[[LaunchRequest], Cluster] = LocalCluster

    def run(self, folder: str, stop_requested: threading.Event) -> None:
        try:
            journal = JournalWriter(os.path.join(folder, "journal"))
            launch = Launch(self.cluster(dataclasses.replace(self.request, display=journal)))
        except BaseException as error:
            store.finish(folder, "failed", ("error", error))
            raise
        store.write_state(folder, log_dir=launch.log_dir, status="running")
        signal.signal(signal.SIGTERM, lambda *_: launch.cancel())
        signal.signal(signal.SIGUSR1, lambda *_: launch.request_stacks())
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no terminal: an interrupt is not this user's wish
        if stop_requested.is_set():  # cancelled while it was being set up
            launch.cancel()
        launch.start(stop_at_exit=False)
        try:  # the main thread's wait is interrupted by the signals, whose handlers run here
            outcome = ("ok", launch.result())
        except BaseException as error:
            outcome = ("error", error)
        store.finish(folder, launch.status, outcome)
