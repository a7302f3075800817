"""``notebook_launcher(..., cluster="slurm")``: the ranks live on the nodes of a Slurm
allocation (a cluster: ``launch/cluster_interface.Cluster``).

Slurm only starts processes: one job step (``srun``, ``cluster/slurm_step``) runs nblaunch's
agent on every node of the allocation (``cluster/slurm_allocation``: this kernel's, or one srun
asks for). Each agent connects back to this kernel (``cluster/node_socket``), says where it is,
and runs nblaunch's own launch of that node's ranks, as a Ray node's agent does; node 0's
launcher hosts the rendezvous. ``cluster/watcher.NodesWatcher`` merges the nodes' events into
the cell. After every attempt the agents end, srun with them, and nothing is left in Slurm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
import sys
from typing import Any, Callable, ClassVar, Iterator

import cloudpickle

from nblaunch.cluster.agent import check_cluster_request
from nblaunch.cluster.node_socket import Hub
from nblaunch.cluster.slurm_allocation import find_allocation
from nblaunch.cluster.slurm_kept import kept_on_slurm, submit
from nblaunch.cluster.slurm_start import SlurmStart
from nblaunch.cluster.slurm_step import AgentStep
from nblaunch.contract import variables as v
from nblaunch.detached import store
from nblaunch.detached.kept_launch import KeptLaunch
from nblaunch.events import Event
from nblaunch.launch.errors import LaunchConfigError
from nblaunch.launch.local_cluster import LaunchJob
from nblaunch.launch.planning import pickling
from nblaunch.launch.planning.plan import (
    LaunchPlan,
    check_fp8,
    decided_precision,
    plural,
    ranks_per_node,
)
from nblaunch.launch.planning.request import LaunchRequest
from nblaunch.launch.processes.packing import Payload
from nblaunch.launch.processes.processes import PACKAGE_ROOT



class SlurmCluster:
    """The ranks of a launch, one agent per node of a Slurm allocation (see the module's docstring)."""

    starts_every_node: ClassVar[bool] = True
    detaches_warm_ranks: ClassVar[bool] = False

    def __init__(self, request: LaunchRequest) -> None:
        """Check a Slurm launch's request against the allocation; nothing is started yet."""
        r = request
        check_cluster_request(r, "slurm", "Slurm starts")
        pickling.check_picklable(r.function, r.args)
        self.allocation = allocation = find_allocation(r.num_nodes, r.resources)
        num_nodes = r.num_nodes or max(1, len(allocation.nodes))
        gpus = 0 if r.cpu else allocation.gpus_per_node
        num_processes = ranks_per_node(r, gpus)
        if r.num_processes is None and not gpus and allocation.job_id is not None:
            num_processes = min(num_processes, allocation.cpus_per_node)  # salloc -N2 gives 1 CPU each
        if gpus and num_processes > gpus:
            raise LaunchConfigError(
                f"num_processes={num_processes}, but each node has {plural(gpus, 'GPU')} for the launch and a GPU rank "
                f"needs one of its own: pass num_processes={gpus} or fewer, or cpu=True")
        cpus = allocation.cpus_per_node or num_processes
        if allocation.job_id is not None and not gpus and num_processes > cpus:
            raise LaunchConfigError(
                f"num_processes={num_processes}, but Slurm job {allocation.job_id} gives each node "
                f"{plural(cpus, 'CPU')}: pass num_processes={cpus} or fewer, or ask Slurm for more CPUs per node")
        self._step_options = allocation.step_options(num_nodes, cpus, gpus)
        self._shape = (num_nodes, cpus, gpus)
        precision = r.mixed_precision if gpus else decided_precision(r.mixed_precision, "cpu", None)
        check_fp8(precision, "cuda" if gpus else "cpu")
        kind = plural(num_processes, "CUDA GPU") if gpus else "CPU"
        self.plan = LaunchPlan(
            request=r, num_processes=num_processes, num_nodes=num_nodes, node_rank=0, master_addr="node 0",
            master_port=r.use_port or 0, start_method="slurm",
            start_reason=f"{plural(num_nodes, 'node')} of {allocation.describe}, one nblaunch agent on each started "
                         "by srun; each starts its ranks as a launch on one machine does",
            device_kind="cuda" if gpus else "cpu",
            devices=f"{kind}, {plural(num_processes, 'rank')} on each of {plural(num_nodes, 'Slurm node')}",
            shown_ranks=num_processes * num_nodes, precision=precision,
            meeting_point="node 0, once srun has started the agents", port_pinned=r.use_port is not None,
        )
        # What each node's agent launches there: its share, the driver keeping the clock.
        self._node_request = dataclasses.replace(r, cluster=None, resources=None, num_nodes=num_nodes,
                                                 num_processes=num_processes, cpu=not gpus, timeout=None,
                                                 display="none")
        self._log_dir = ""

    def prepare(self, launch_id: str) -> None:
        pass  # each node's own launch prepares there

    def shared_log_root(self) -> str | None:
        # The state folder is on the home directory every node shares: the logs of a launch kept
        # by a batch job, or run from a node of the allocation, are read from the login node too.
        return os.path.join(store.state_root(), "logs")

    def package(self, value: Any) -> Payload:
        return Payload(cloudpickle.dumps(value, protocol=5))  # memfds stay on one machine

    @contextlib.contextmanager
    def attempt(self, plan: LaunchPlan, emit: Callable[[Event], None], time_left: float | None,
                log_dir: str) -> Iterator[SlurmStart]:
        token = secrets.token_hex(16)
        packed = cloudpickle.dumps(self._node_request)  # the function and its arguments, once for every node
        dropped = (v.SLURM_INPUT_PREFIXES, v.SLURM_JOB_LEVEL)
        with Hub(token) as hub:
            environ = {v.AGENT_TOKEN: token, "PYTHONPATH": _with_our_root(os.environ.get("PYTHONPATH", ""))}
            step = AgentStep(self.allocation, self._step_options, f"nblaunch-{secrets.token_hex(4)}",
                             _driver_address(self.allocation.nodes), hub.port, environ,
                             os.path.join(log_dir, "srun.log"))
            start = SlurmStart(hub, step, plan, lambda place: ("start", packed, place, list(sys.path), dropped),
                               emit, time_left)
            try:
                yield start
            finally:
                hub.close()  # every agent stops its ranks, if any still run, and ends
                step.stop(agents_came=start.placed)

    def keep(self) -> KeptLaunch:
        # The batch job's own allocation is the launch's: inside it, the request asks for nothing more.
        request = dataclasses.replace(self.plan.request, display="none", resources=None, num_nodes=self._shape[0])
        return submit(LaunchJob(request, SlurmCluster), self.allocation, *self._shape,
                      _with_our_root(os.environ.get("PYTHONPATH", "")), function=request.function_name,
                      num_processes=self.plan.world_size)

    @staticmethod
    def kept(kinds: tuple[str, ...]) -> list[KeptLaunch]:
        return list(kept_on_slurm()) if "launch" in kinds else []


def _driver_address(nodes: tuple[str, ...]) -> str:
    """This machine's address as the nodes reach it: the one its route to the first node leaves
    from (a host name often resolves to 127.0.1.1, which no other node can reach), else its host
    name's (outside an allocation the nodes are not known yet)."""
    try:
        by_name = socket.gethostbyname(socket.gethostname())
    except OSError:
        by_name = "127.0.0.1"
    if not nodes or not by_name.startswith("127."):
        return by_name
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(nodes[0]), 9))  # a UDP "connect" sends nothing
            return probe.getsockname()[0]
    except OSError:
        return by_name


def _with_our_root(pythonpath: str) -> str:
    """PYTHONPATH with the folder this nblaunch is imported from first: the agents run the same."""
    return os.pathsep.join([PACKAGE_ROOT] + [p for p in pythonpath.split(os.pathsep) if p and p != PACKAGE_ROOT])
