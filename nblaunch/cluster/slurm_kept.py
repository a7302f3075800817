"""Detached launches on Slurm (``detach=True``): the launch runs as a Slurm batch job of its own.

The kernel writes the launch's folder in its state folder (``detached/store``: under the home
directory, which a cluster's nodes share) and submits ``sbatch`` for the nodes the launch needs;
the batch script is nblaunch's supervisor (``detached/daemon --here``), which runs the same
``LaunchJob`` as a local detached launch, with ``SlurmCluster``, inside that job's allocation. The
kernel may then die: ``launches()`` and ``attach()`` in any kernel of the user's, on any machine
of the cluster, find the folder, read its journal, and ask squeue whether the job still runs.
Cancelling signals the batch script (the supervisor) through ``scancel``; a job that ended
without an outcome is said to be lost, pointing at its output.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from nblaunch.cluster.slurm_allocation import Allocation, run_tool, slurm_tool, tool_environ
from nblaunch.detached import store
from nblaunch.detached.jobs import new_job_folder
from nblaunch.detached.kept_launch import KeptInAFolder
from nblaunch.launch.errors import LaunchCancelledError, LaunchConfigError

KIND = "slurm launch"  # the state's kind: this machine's supervisors list "launch" folders only
_ASK_EVERY_S = 2.0
_OVER = ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL")


def submit(job: Any, allocation: Allocation, num_nodes: int, cpus: int, gpus: int, pythonpath: str,
           **state: Any) -> "KeptInSlurm":
    """Write ``job`` (a ``LaunchJob`` with ``SlurmCluster``) to a new launch folder and submit the
    batch job that supervises it, asking for the nodes the launch would use here."""
    folder = new_job_folder(job, kind=KIND, **state)
    options = [f"--nodes={num_nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]
    options += [f"--gpus-per-node={gpus}"] if gpus else []
    if allocation.job_id is None:
        options += list(allocation.asked)
    else:  # from inside an allocation: a job of its own, where this one runs
        options += [f"--{name}={os.environ[variable]}" for name, variable in
                    (("partition", "SLURM_JOB_PARTITION"), ("account", "SLURM_JOB_ACCOUNT"))
                    if os.environ.get(variable)]
    supervisor = f"exec {sys.executable} -m nblaunch.detached.daemon --here {folder}"
    try:
        job_id = run_tool([slurm_tool("sbatch"), "--parsable", f"--job-name=nblaunch-{os.path.basename(folder)}",
                           f"--output={os.path.join(folder, 'supervisor.log')}", f"--chdir={os.getcwd()}", *options,
                           "--wrap", supervisor], tool_environ({"PYTHONPATH": pythonpath})).strip().split(";")[0]
    except LaunchConfigError as error:
        store.finish(folder, "failed", ("error", error))
        raise
    store.write_state(folder, slurm_job=job_id)
    return KeptInSlurm(folder)


class KeptInSlurm(KeptInAFolder):
    """A launch kept by a Slurm batch job: its folder as on this machine, its life in squeue."""

    where = "a Slurm batch job"

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        self._asked_at = -_ASK_EVERY_S
        self._running = True

    def alive(self) -> bool:
        state = self.state()
        if "ended" in state or state.get("slurm_job_over"):
            return False
        job = state.get("slurm_job")
        if job is None or time.monotonic() - self._asked_at < _ASK_EVERY_S:
            return self._running  # being submitted; or squeue was asked a moment ago (a dashboard asks often)
        status = self._job_state(job)
        if status is None:
            return True  # Slurm cannot be asked now; the job's own end will show
        self._asked_at, self._running = time.monotonic(), status not in _OVER
        if not self._running:
            # Remembered: squeue forgets a job minutes after it ended (then "Invalid job id").
            store.write_state(self.folder, slurm_job_over=True)
            # The job may end between the supervisor's last word and this answer: its folder decides.
            return "ended" in self.state()
        return True

    @staticmethod
    def _job_state(job: str) -> str | None:
        """squeue's state of ``job`` ("" once it is gone), None when squeue cannot be asked."""
        try:
            return run_tool([slurm_tool("squeue"), "-h", "-j", job, "-o", "%T"]).strip()
        except LaunchConfigError as error:
            return "" if "Invalid job id" in str(error) else None

    def signal(self, what: str) -> bool:
        state = self.state()
        if "ended" in state or "slurm_job" not in state or not self.alive():
            return False
        job = state["slurm_job"]
        if self._job_state(job) == "PENDING":
            if what == "cancel":  # never started: Slurm forgets it, and the launch is said cancelled here
                run_tool([slurm_tool("scancel"), job])
                store.finish(self.folder, "cancelled", ("error", LaunchCancelledError(
                    f"the detached launch was cancelled while its Slurm job {job} waited in the queue")))
            return what == "cancel"
        name = {"cancel": "TERM", "stacks": "USR1"}[what]
        # The batch script is the supervisor itself (exec): its handlers cancel, or ask for stacks.
        run_tool([slurm_tool("scancel"), "--batch", f"--signal={name}", job])
        return True

    def lost_message(self) -> str:
        job = self.state().get("slurm_job", "?")
        return (f"Slurm job {job}, which kept detached launch {self.launch_id} ({self.state()['function']}), ended "
                f"before the launch did (cancelled, out of time, or its node failed: `sacct -j {job}` says which). "
                f"Its output is in {os.path.join(self.folder, 'supervisor.log')}")


def kept_on_slurm() -> list[KeptInSlurm]:
    """This user's detached Slurm launches (their folders are on the shared home directory)."""
    return [KeptInSlurm(folder) for folder in store.launch_folders(kind=KIND)]
