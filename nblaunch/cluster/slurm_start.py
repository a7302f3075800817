"""The first part of a Slurm attempt, as its Launch sees it: waiting for Slurm and the agents.

A job may wait in the queue for minutes or hours, so the Launch gets this watcher at once:
while srun waits for the job and the agents connect, a cancel (the dashboard's stop button, an
interrupt) or the launch's ``timeout=`` ends the wait, and the cell shows squeue's reason. Once
every node's agent has said hello it places the ranks and hands over to a
:class:`~nblaunch.cluster.watcher.NodesWatcher`, which does the rest.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from nblaunch.cluster.agent import NodePlace
from nblaunch.cluster.node_socket import Hub, SocketLinks
from nblaunch.cluster.slurm_step import AgentStep
from nblaunch.cluster.watcher import NodesWatcher
from nblaunch.contract.version import __version__
from nblaunch.events import ClusterWaiting, Event, RanksPlaced
from nblaunch.launch.errors import LaunchCancelledError, LaunchConfigError, LaunchTimeoutError
from nblaunch.launch.planning.plan import LaunchPlan
from nblaunch.launch.processes.packing import Payload

AGENTS_START_S = 120.0  # from the nodes being given to every agent connected: Python and torch starting
_QUEUE_CHECK_S = 2.0  # how often squeue is asked while the job waits


class SlurmStart:
    """A ``RankWatcher`` for a Slurm attempt (see the module's docstring). ``start_message(place)``
    is what each agent is sent to start its node's ranks."""

    def __init__(self, hub: Hub, step: AgentStep, plan: LaunchPlan, start_message: Callable[[NodePlace], tuple],
                 emit: Callable[[Event], None], time_left: float | None) -> None:
        self._hub, self._step, self._plan = hub, step, plan
        self._start_message = start_message
        self._emit = emit
        self._time_left = time_left
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._cancel_as: BaseException | None = None
        self._nodes: NodesWatcher | None = None
        self._placed = threading.Event()  # or given up

    @property
    def placed(self) -> bool:
        """Whether every node's agent came (after the attempt: whether the step must be cancelled)."""
        return self._nodes is not None

    def cancel(self, raising: BaseException | None = None) -> None:
        with self._lock:
            if self._nodes is not None:
                self._nodes.cancel(raising)
                return
            self._cancel_as = raising
            self._cancelled.set()

    def request_stacks(self) -> None:
        with self._lock:
            nodes = self._nodes
        if nodes is not None:
            nodes.request_stacks()

    def send_to_ranks(self, kind: bytes, body: bytes = b"", shared: Payload | None = None) -> None:
        self._placed.wait()  # a warm pool's first call waits for its ranks
        if self._nodes is not None:
            self._nodes.send_to_ranks(kind, body, shared)

    def run(self) -> list[Any]:
        try:
            agents = self._wait_for_agents()
            nodes = self._place(agents)
        finally:
            self._placed.set()
        return nodes.run()

    def _wait_for_agents(self) -> list[Any]:
        plan, step = self._plan, self._step
        next_check = 0.0
        while not self._hub.accept_for(plan.num_nodes, 0.2):
            if self._cancelled.is_set():
                raise self._cancel_as or LaunchCancelledError("the launch was cancelled before Slurm started it")
            why_not = step.ended()
            if why_not is not None:
                raise LaunchConfigError(why_not)
            waited = time.monotonic() - self._started
            if self._time_left is not None and waited > self._time_left:
                raise LaunchTimeoutError(self._time_left, {})
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _QUEUE_CHECK_S
                line = step.waiting_line()
                if line is not None:
                    self._emit(ClusterWaiting(line))
            running_for = step.running_for()
            if running_for is not None and running_for > AGENTS_START_S:
                raise LaunchConfigError(self._missing_agents(running_for))
        return self._hub.in_order()

    def _missing_agents(self, waited: float) -> str:
        missing = [node for node in range(self._plan.num_nodes) if node not in self._hub.agents]
        names = self._step.allocation.nodes
        where = ", ".join(f"node {n}" + (f" ({names[n]})" if n < len(names) else "") for n in missing)
        advice = ("is the same Python environment, with nblaunch, on every node? (srun.log in the launch's log "
                  "folder has what the agents printed)")
        if self._step.allocation.job_id is None:
            advice += "; can the compute nodes open a connection to this machine? (run the notebook inside the "
            advice += "allocation if a firewall stands between them)"
        return (f"nblaunch's agent on {where} did not reach this kernel (port {self._hub.port}) within "
                f"{waited:.0f} s of the job running: {advice}")

    def _place(self, agents: list[Any]) -> NodesWatcher:
        plan = self._plan
        for index, agent in enumerate(agents):
            if agent.version != __version__:
                raise LaunchConfigError(f"node {index} ({agent.address}) has nblaunch {agent.version}, this "
                                        f"notebook {__version__}: use the same environment on every node")
        port = plan.master_port if plan.port_pinned else agents[0].free_port
        self._emit(RanksPlaced(tuple(a.address for a in agents), plan.num_processes, agents[0].address, port))
        for index, agent in enumerate(agents):
            agent.send(self._start_message(NodePlace(index, agents[0].address, port)))
        left = None
        if self._time_left is not None:
            left = max(0.0, self._time_left - (time.monotonic() - self._started))
        links = SocketLinks(agents, f"; srun's output is in {self._step.log_path}")
        with self._lock:
            self._nodes = NodesWatcher(links, plan.num_nodes, plan.num_processes, self._emit, left)
            if self._cancelled.is_set():
                self._nodes.cancel(self._cancel_as)
        return self._nodes
