"""The job step that runs a Slurm launch's agents: one ``srun``, watched and stopped.

``srun`` runs in a session of its own (an interrupt in the kernel is the launch's to handle,
not srun's), its output in the launch's log folder. Outside an allocation the same ``srun``
first asks for the job and waits in the queue; :meth:`AgentStep.waiting_line` says why, in
squeue's words. :meth:`AgentStep.stop` leaves nothing: srun is given time to end with its
agents, then stopped, then the step is cancelled by Slurm (``scancel``), and a job this launch
asked for is given back.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

from nblaunch.cluster.slurm_allocation import (
    Allocation,
    run_tool,
    slurm_tool,
    tool_environ,
)
from nblaunch.contract import variables as v
from nblaunch.launch.errors import LaunchConfigError

_END_S = 40.0  # agents stop their ranks (stacks first) in a second or two; a node that hangs gets this long
_OUTPUT_TAIL = 2000  # characters of srun's output quoted when it ends before its agents come


class AgentStep:
    """``srun`` running ``python -m nblaunch.cluster.socket_agent`` on every node of a launch."""

    def __init__(self, allocation: Allocation, options: list[str], name: str, hub_address: str, hub_port: int,
                 environ: dict[str, str], log_path: str) -> None:
        self.allocation = allocation
        self.name = name  # the job's name (outside) or the step's (inside): how squeue finds it
        self.log_path = log_path
        # srun dies with the launch's thread (a kernel killed): its shepherd then cancels the step.
        # Its own session: a Ctrl-C or a killpg of the kernel's group never reaches it (srun would
        # leave the step behind for ever when its whole group is SIGKILLed).
        with_the_kernel = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        command = [*with_the_kernel, slurm_tool("srun"), *options, f"--job-name={name}", "--input=none", sys.executable, "-m",
                   "nblaunch.cluster.socket_agent", hub_address, str(hub_port), v.SLURM_PROCID,
                   v.SLURM_LAUNCH_NODE_IPADDR]
        self._log = open(log_path, "ab")
        self._log.write((" ".join(command) + "\n").encode())
        self._log.flush()
        self._srun = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                      env=tool_environ(environ), start_new_session=True)
        self._job_id = allocation.job_id
        self._last_line = ""
        # Inside an allocation the step starts at once; a job asked for starts when squeue says so.
        self._running_since: float | None = time.monotonic() if allocation.job_id is not None else None

    def running_for(self) -> float | None:
        """Seconds since the job began running (None: still waiting, as far as is known)."""
        return None if self._running_since is None else time.monotonic() - self._running_since

    def ended(self) -> str | None:
        """Why the agents will never come, if srun has ended; else None."""
        if self._srun.poll() is None:
            return None
        self._log.flush()
        with open(self.log_path, errors="replace") as log:
            tail = log.read()[-_OUTPUT_TAIL:].strip()
        return (f"Slurm's srun ended (exit status {self._srun.returncode}) before nblaunch's agents reached this "
                f"kernel; it said:\n{tail}")

    @property
    def job_id(self) -> str | None:
        """The job the agents run in: this kernel's, or the one srun asked for once squeue lists it."""
        if self._job_id is None:
            found = run_tool([slurm_tool("squeue"), "-h", f"--name={self.name}", "-o", "%i"]).split()
            self._job_id = found[0] if found else None
        return self._job_id

    def waiting_line(self) -> str | None:
        """Outside an allocation: what squeue says of the job while it waits, when that changed.
        A controller too busy to answer is said so; the wait goes on."""
        if self.allocation.job_id is not None:
            return None
        try:
            line = self._job_status()
        except LaunchConfigError as error:
            line = f"squeue did not answer ({str(error).splitlines()[0][-200:]}); still waiting for the job"
        if line == self._last_line:
            return None
        self._last_line = line
        return line

    def _job_status(self) -> str:
        job = self.job_id
        if job is None:
            return "asking Slurm for an allocation ..."
        state = run_tool([slurm_tool("squeue"), "-h", "-j", job, "-o", "%T|%r"]).strip()
        status, _, reason = state.partition("|")
        if status == "PENDING":
            queue = run_tool([slurm_tool("squeue"), "-h", "-t", "PENDING", "--sort=-p,i", "-o", "%i"]).split()
            place = f", {queue.index(job) + 1} of {len(queue)} waiting" if job in queue else ""
            return f"Slurm job {job} is waiting in the queue ({reason}{place})"
        if status and self._running_since is None:
            self._running_since = time.monotonic()
        return f"Slurm job {job} is {status.lower() or 'starting'}: starting nblaunch's agents on its nodes"

    def stop(self, agents_came: bool) -> None:
        """srun ends with its agents (they end when the driver closes); if not in time it is
        stopped, the step cancelled, and a job asked for here cancelled. ``agents_came`` False
        (the job still queued, or an agent missing): nothing is waited for, Slurm cancels first."""
        try:
            if not agents_came:
                self._cancel_leftovers()
            self._srun.wait(_END_S if agents_came else _END_S / 4)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGTERM)  # srun passes it on to the agents, which stop their ranks
            try:
                self._srun.wait(_END_S / 4)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self._srun.wait()
        finally:
            self._log.close()
            self._cancel_leftovers()

    def _signal(self, number: int) -> None:
        try:
            os.killpg(self._srun.pid, number)
        except ProcessLookupError:
            pass

    def _cancel_leftovers(self) -> None:
        """What Slurm still runs for this launch, cancelled (normally nothing)."""
        try:
            if self.allocation.job_id is None:
                if self.job_id is not None:
                    run_tool([slurm_tool("scancel"), self.job_id])
                return
            steps = run_tool([slurm_tool("squeue"), "-h", "-s", "-j", self.allocation.job_id, "-o", "%i|%j"])
            for line in steps.splitlines():
                step, _, name = line.partition("|")
                if name.strip() == self.name:
                    run_tool([slurm_tool("scancel"), step.strip()])
        except LaunchConfigError:
            pass  # Slurm cannot be asked now: its own limits end the step with the job
