"""Watching a launch of several nodes from the notebook: every node's event stream merged into one.

Each node's agent (``cluster/agent.NodeAgent``) runs a local launch of its ranks and keeps its
events; the cluster's :class:`NodeLinks` brings them here (Ray: long-polls through ``ray.wait``;
Slurm: frames over a socket). This watcher renumbers each node's ranks into the world's (node
k's local rank r is rank ``k * ranks_per_node + r``) and hands the events to the launch's
display and logs, as a local supervisor would. The node launches stop themselves when one of
their ranks fails; this watcher stops the *other* nodes at the first sign of it (a rank shown
failing, or an agent lost), and on interrupt, timeout or cancel stops them all.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import cloudpickle

from nblaunch.contract.failure import Phase, RankFailure
from nblaunch.events import Event, RankFinished, RankState, Stacks
from nblaunch.launch.errors import (
    LaunchCancelledError,
    LaunchInterrupted,
    LaunchTimeoutError,
    RankFailedError,
)
from nblaunch.launch.processes.packing import Payload

_CHECK_S = 0.05  # how often the loop looks at cancel requests and the deadline
_STOP_BACKSTOP_S = 30.0  # stopping a node takes about a second; past this its agent is killed anyway


@dataclass
class NodeNews:
    """What came from node ``index``'s agent: events, its launch's outcome once over (see
    ``NodeAgent._wait_for_end``), or ``lost``: why its agent is gone or cannot be read, in words."""

    index: int
    events: list[Event] = field(default_factory=list)
    outcome: tuple | None = None
    lost: str | None = None


class NodeLinks(Protocol):
    """A cluster's way to the agents of its nodes (node k is ``k``). The commands never wait for
    an answer and are safe to send to an agent that is gone."""

    def poll(self, live: list[int], timeout: float) -> list[NodeNews]:
        """The news from the ``live`` nodes that arrives within ``timeout`` seconds."""

    def cancel(self, index: int, why: str) -> None:
        """Stop that node's ranks (``why``: "stop" or "timeout"), stacks first."""

    def request_stacks(self, index: int) -> None: ...

    def send(self, index: int, kind: bytes, body: bytes) -> None:
        """One frame to every rank of that node (a warm pool's call)."""


class _Node:
    """One node's agent as the watcher sees it."""

    def __init__(self, index: int, first_rank: int, num_ranks: int):
        self.index = index
        self.first_rank = first_rank
        self.ranks = range(first_rank, first_rank + num_ranks)
        self.outcome: tuple | None = None
        self.asked_to_stop = False
        self.finished: set[int] = set()  # ranks whose RankFinished was shown


class NodesWatcher:
    """Runs a launch's nodes to the end and returns every rank's result in rank order."""

    def __init__(self, links: NodeLinks, num_nodes: int, ranks_per_node: int, emit: Callable[[Event], None],
                 timeout: float | None):
        self._links = links
        self._nodes = [_Node(i, i * ranks_per_node, ranks_per_node) for i in range(num_nodes)]
        self._emit = emit
        self._timeout = timeout
        self._stacks: dict[int, str] = {}
        self._shown_failed: list[int] = []
        self._done: list[int] = []  # ranks shown finishing with a result
        self._cancel_requested = False
        self._cancel_as: BaseException | None = None
        self._stacks_requested = False

    # ------------------------------------------------------------------ the watcher protocol
    def cancel(self, raising: BaseException | None = None) -> None:
        self._cancel_as = raising
        self._cancel_requested = True

    def request_stacks(self) -> None:
        self._stacks_requested = True

    def send_to_ranks(self, kind: bytes, body: bytes = b"", shared: Payload | None = None) -> None:
        if shared is not None and shared.fds:
            raise NotImplementedError("memory shared by file descriptors cannot cross machines")
        for node in self._live():
            self._links.send(node.index, kind, body)

    def run(self) -> list[Any]:
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        stopping: str | None = None  # why every node is being stopped: "failure", "timeout", "cancel"
        stop_backstop = None
        try:
            while any(node.outcome is None for node in self._nodes):
                self._pump()
                if stop_backstop is None and stopping is not None:
                    stop_backstop = time.monotonic() + _STOP_BACKSTOP_S
                if stop_backstop is not None and time.monotonic() > stop_backstop:
                    for node in self._live():  # its agent is killed on the way out
                        self._lose(node, f"its node did not stop within {_STOP_BACKSTOP_S:g} s")
                if self._stacks_requested:
                    self._stacks_requested = False
                    for node in self._live():
                        self._links.request_stacks(node.index)
                if stopping is None and self._failed():
                    stopping = "failure"
                    self._stop_all("stop")
                elif stopping is None and self._cancel_requested:
                    stopping = "cancel"
                    self._stop_all("stop")
                elif stopping is None and deadline is not None and time.monotonic() >= deadline:
                    stopping = "timeout"
                    self._stop_all("timeout")
        except KeyboardInterrupt:
            self._stop_all("stop")
            self._pump_until_ended()
            raise LaunchInterrupted("every rank was stopped; where each one was is shown above") from None
        failures = self._failures()
        if stopping in ("timeout", "cancel"):
            # Nodes stop a few milliseconds apart: a rank that lost a peer stopped earlier on
            # another node was stopped, it did not fail.
            failures = [f for f in failures if not f.collateral]
        if failures:
            raise self._failure_error(failures)
        if stopping == "timeout":
            raise LaunchTimeoutError(self._timeout or 0.0, dict(self._stacks))
        if stopping == "cancel":
            raise self._cancel_as or LaunchCancelledError("the launch was cancelled; every rank was stopped")
        broken = [node for node in self._nodes if node.outcome[0] != "done"]
        if broken:  # a node's launch broke without a rank to blame: the one not told to stop says why
            node = min(broken, key=lambda n: n.asked_to_stop)
            raise RuntimeError(f"node {node.index}'s launch ended without results: {node.outcome[1]}")
        return [value for node in self._nodes for value in _loaded_results(node)]

    @property
    def every_node_ended(self) -> bool:
        """Whether every node's launch was seen to end, none of its agents lost: the agents are
        free for another launch."""
        return all(node.outcome is not None and node.outcome[0] != "lost" for node in self._nodes)

    # ------------------------------------------------------------------ the streams
    def _live(self) -> list[_Node]:
        return [node for node in self._nodes if node.outcome is None]

    def _pump(self) -> None:
        """Handle whatever the live nodes send within ``_CHECK_S``."""
        for news in self._links.poll([node.index for node in self._live()], _CHECK_S):
            node = self._nodes[news.index]
            if node.outcome is not None:
                continue  # already lost: what its agent says now changes nothing
            for event in news.events:
                self._show(node, event)
            if news.lost is not None:
                self._lose(node, news.lost)
            elif news.outcome is not None:
                node.outcome = news.outcome

    def _pump_until_ended(self) -> None:
        end = time.monotonic() + _STOP_BACKSTOP_S
        while self._live() and time.monotonic() < end:
            try:
                self._pump()
            except KeyboardInterrupt:
                continue  # a second interrupt while stopping: the stop is already under way
        for node in self._live():
            self._lose(node, f"its node's nblaunch agent did not stop within {_STOP_BACKSTOP_S:g} s")

    def _show(self, node: _Node, event: Event) -> None:
        rank = getattr(event, "rank", None)
        if rank is not None:
            event = dataclasses.replace(event, rank=node.first_rank + rank)
        if isinstance(event, Stacks):
            self._stacks[event.rank] = event.text
        elif isinstance(event, RankFinished):
            node.finished.add(event.rank)
            if event.state is RankState.FAILED:
                self._shown_failed.append(event.rank)
            elif event.state is RankState.DONE:
                self._done.append(event.rank)
        self._emit(event)

    def _lose(self, node: _Node, reason: str) -> None:
        """The agent is gone (or unreadable): every rank of its node that had not finished
        failed with it. Its agent is killed when the launch's nodes are released."""
        local = [r - node.first_rank for r in node.ranks if r not in node.finished]
        node.outcome = ("lost", [RankFailure(r, reason, phase=Phase.ENDED) for r in local])
        for r in local:
            self._show(node, RankFinished(rank=r, state=RankState.FAILED, detail=reason))

    def _stop_all(self, why: str) -> None:
        for node in self._live():
            if not node.asked_to_stop:
                node.asked_to_stop = True
                self._links.cancel(node.index, why)

    def _failed(self) -> bool:
        return bool(self._shown_failed) or any(n.outcome is not None and n.outcome[0] != "done" for n in self._nodes)

    # ------------------------------------------------------------------ the end
    def _failures(self) -> list[RankFailure]:
        failures = []
        for node in self._nodes:
            kind, detail = node.outcome
            if kind in ("failed", "lost"):  # numbered as on its node: renumbered into the world's
                failures += [dataclasses.replace(failure, rank=node.first_rank + failure.rank) for failure in detail]
        return failures

    def _failure_error(self, failures: list[RankFailure]) -> RankFailedError:
        return RankFailedError.blaming(failures, dict(self._stacks), self._shown_failed, sorted(self._done))


def _loaded_results(node: _Node) -> list[Any]:
    try:
        return cloudpickle.loads(node.outcome[1])
    except Exception as error:
        raise RuntimeError(
            f"the results of node {node.index} could not be loaded here ({first_line(error)}): return values this "
            "machine can load (plain Python values, CPU tensors)"
        ) from None


def first_line(error: BaseException) -> str:
    """``error`` in one line: its type and the first line of its text."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
