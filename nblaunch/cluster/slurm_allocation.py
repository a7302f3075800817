"""What a Slurm launch runs on: the allocation this kernel sits in, or the one it asks for.

Slurm's own tools do the work (``scontrol``, ``srun``, ``squeue``): nothing here schedules.
Inside an allocation (``SLURM_JOB_ID`` is set: a kernel started by Open OnDemand or a batch
spawner, or in ``salloc``) the launch uses the allocation as it is, narrowed by ``num_nodes``;
outside (a login node) it asks for what ``resources=`` names, what the user's ``SBATCH_*``
variables already say filling the gaps, and ``srun`` waits in the queue for it.

Example::

    allocation = find_allocation(request.num_nodes, request.resources)
    allocation.step_options(num_nodes=2, cpus=4, gpus=0)   # srun's options for the agents' step
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Mapping

from nblaunch.contract import variables as v
from nblaunch.launch.errors import LaunchConfigError

_TOOL_S = 30.0  # scontrol and squeue answer in milliseconds; a controller that is down takes this long

# resources= keys: srun's option for each (what sbatch and srun call it), checked before anything starts.
ASKABLE = {
    "partition": "--partition", "account": "--account", "time": "--time", "qos": "--qos",
    "reservation": "--reservation", "constraint": "--constraint", "mem": "--mem",
    "gpus_per_node": "--gpus-per-node", "cpus_per_node": "--cpus-per-task",
}


@dataclass(frozen=True)
class Allocation:
    """The nodes a launch may use. ``job_id`` None: not allocated yet (``asked`` says what
    srun will ask for); else the allocation's ``nodes`` by name."""

    job_id: str | None
    nodes: tuple[str, ...]
    cpus_per_node: int
    gpus_per_node: int
    asked: tuple[str, ...] = ()

    @property
    def describe(self) -> str:
        if self.job_id is None:
            return "a new Slurm allocation (" + " ".join(self.asked) + ")" if self.asked else "a new Slurm allocation"
        return f"Slurm job {self.job_id} ({len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''})"

    def step_options(self, num_nodes: int, cpus: int, gpus: int) -> list[str]:
        """srun's options for one agent per node on ``num_nodes`` nodes, each with ``cpus`` CPUs
        and ``gpus`` GPUs for its ranks. Inside an allocation the step shares it (``--overlap``)
        with whatever else runs there (this kernel, maybe); outside, srun asks for the job."""
        options = [f"--nodes={num_nodes}", f"--ntasks={num_nodes}", "--ntasks-per-node=1",
                   f"--cpus-per-task={cpus}", "--cpu-bind=none", "--kill-on-bad-exit=1"]
        if gpus:
            options.append(f"--gpus-per-node={gpus}")
        if self.job_id is not None:
            return [f"--jobid={self.job_id}", "--overlap", f"--nodelist={','.join(self.nodes[:num_nodes])}"] + options
        return options + list(self.asked)


def slurm_tool(name: str) -> str:
    """The path of Slurm's ``name`` (srun, squeue, ...), or a LaunchConfigError saying what to do."""
    path = shutil.which(name)
    if path is None:
        raise LaunchConfigError(f"cluster='slurm' needs Slurm's {name} on PATH (run the notebook on a node of the "
                                "Slurm cluster, where `module load slurm` or the like provides it)")
    return path


def run_tool(args: list[str], environ: dict[str, str] | None = None) -> str:
    """A Slurm tool's output; its error, said, when it fails. ``environ``: ``tool_environ()``'s."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=_TOOL_S, env=environ or tool_environ(),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LaunchConfigError(f"{' '.join(args)} did not answer in {_TOOL_S:g} s: is slurmctld up?") from None
    if done.returncode != 0:
        raise LaunchConfigError(f"{' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def tool_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without what Slurm's tools would read as options: a step
    started from inside a job must not inherit the job's task counts, CPU binding, or a
    ``SLURM_JOB_ID`` (given as ``--jobid`` where meant). ``SLURM_CONF`` says which cluster."""
    environ = {name: value for name, value in os.environ.items()
               if not name.startswith(v.SLURM_INPUT_PREFIXES) or name == v.SLURM_CONF}
    environ.update(extra or {})
    return environ


def find_allocation(num_nodes: int | None, resources: Mapping[str, Any] | None) -> Allocation:
    """The allocation of this kernel, or the one ``resources`` asks for (see the module's
    docstring). Raises LaunchConfigError before anything is asked of Slurm when a setting cannot work."""
    slurm_tool("srun")
    job_id = os.environ.get(v.SLURM_JOB_ID)
    if job_id:
        if resources:
            raise LaunchConfigError(
                f"this kernel runs inside Slurm job {job_id}, whose nodes the launch uses: leave resources= out "
                "(num_nodes= and num_processes= narrow the allocation), or run the notebook on a login node "
                "to ask for a new allocation")
        return _current(job_id, num_nodes)
    return _asked(resources or {}, num_nodes or 1)


def _current(job_id: str, num_nodes: int | None) -> Allocation:
    nodelist = os.environ.get(v.SLURM_JOB_NODELIST, "")
    nodes = tuple(run_tool([slurm_tool("scontrol"), "show", "hostnames", nodelist]).split()) if nodelist else ()
    if not nodes:
        raise LaunchConfigError(f"Slurm job {job_id} names no nodes ({v.SLURM_JOB_NODELIST} is empty): is this "
                                "kernel inside the job's allocation?")
    if num_nodes is not None and num_nodes > len(nodes):
        raise LaunchConfigError(
            f"num_nodes={num_nodes}, but Slurm job {job_id} holds {len(nodes)} node{'s' if len(nodes) != 1 else ''} "
            f"({', '.join(nodes)}): pass num_nodes={len(nodes)} or fewer (or leave it out), or ask Slurm for more")
    return Allocation(job_id, nodes, min(cpu_counts(os.environ.get(v.SLURM_JOB_CPUS_PER_NODE, ""))),
                      _gpus_on_node())


def cpu_counts(coded: str) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE`` read: ``"4(x2),2"`` is ``[4, 4, 2]``; ``[1]`` when unset."""
    counts: list[int] = []
    for part in filter(None, coded.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts or [1]


def _gpus_on_node() -> int:
    """The GPUs the job has on each node: Slurm's count on this node (the kernel's), else what
    the job asked for each node (a kernel on a login node, in salloc, has no GPU of the job),
    else the list of this node's."""
    count = os.environ.get(v.SLURM_GPUS_ON_NODE, "")
    if count.isdigit():
        return int(count)
    asked = re.fullmatch(r"(?:[\w-]+:)?(\d+)", os.environ.get(v.SLURM_GPUS_PER_NODE, "").strip())
    if asked:
        return int(asked.group(1))
    listed = os.environ.get(v.SLURM_JOB_GPUS, "")
    return len([g for g in listed.split(",") if g.strip()])


def _asked(resources: Mapping[str, Any], num_nodes: int) -> Allocation:
    unknown = sorted(set(resources) - set(ASKABLE))
    if unknown:
        raise LaunchConfigError(f"resources= does not know {', '.join(map(repr, unknown))}: it takes "
                                f"{', '.join(ASKABLE)} (each as sbatch's option of that name)")
    wanted = {key: os.environ[variable] for key, variable in v.SBATCH_DEFAULTS.items() if os.environ.get(variable)}
    wanted.update({key: value for key, value in resources.items() if value is not None})
    gpus = _count(wanted.pop("gpus_per_node", 0), "gpus_per_node")
    cpus = _count(wanted.pop("cpus_per_node", 0), "cpus_per_node")
    asked = tuple(f"{ASKABLE[key]}={value}" for key, value in wanted.items())
    return Allocation(None, (), cpus, gpus, asked)


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LaunchConfigError(f"resources[{name!r}] must be an int >= 0, got {value!r}")
    return value
