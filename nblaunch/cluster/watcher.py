"""Watching a Ray launch from the notebook: every node's event stream merged into one.

Each node's agent runs a local launch of its ranks and keeps its events; this watcher
long-polls every agent at once (``ray.wait``), renumbers each node's ranks into the world's
(node k's local rank r is rank ``k * ranks_per_node + r``) and hands the events to the
launch's display and logs, as a local supervisor would. The node launches stop themselves
when one of their ranks fails; this watcher stops the *other* nodes at the first sign of it
(a rank shown failing, or an agent lost), and on interrupt, timeout or cancel stops them all.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import cloudpickle

from nblaunch.contract.failure import Phase, RankFailure
from nblaunch.events import Event, RankFinished, RankState, Stacks
from nblaunch.launch.errors import LaunchCancelledError, LaunchInterrupted, LaunchTimeoutError, RankFailedError
from nblaunch.launch.starting.packing import Payload

_POLL_S = 0.2  # how long an agent holds a long-poll open when nothing happens
_CHECK_S = 0.05  # how often the loop looks at cancel requests and the deadline
_STOP_BACKSTOP_S = 30.0  # stopping a node takes about a second; past this its agent is killed anyway


class _Node:
    """One node's agent as the watcher sees it."""

    def __init__(self, index: int, agent: Any, first_rank: int, num_ranks: int):
        self.index = index
        self.agent = agent
        self.first_rank = first_rank
        self.ranks = range(first_rank, first_rank + num_ranks)
        self.pending: Any = None  # the next_events call in flight
        self.outcome: tuple | None = None
        self.asked_to_stop = False
        self.finished: set[int] = set()  # ranks whose RankFinished was shown


class RayWatcher:
    """Runs a Ray launch's nodes to the end and returns every rank's result in rank order."""

    def __init__(self, agents: list[Any], ranks_per_node: int, emit: Callable[[Event], None], timeout: float | None):
        self._nodes = [_Node(i, agent, i * ranks_per_node, ranks_per_node) for i, agent in enumerate(agents)]
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
        for node in self._nodes:
            if node.outcome is None:
                node.agent.send.remote(kind, body)

    def run(self) -> list[Any]:
        import ray

        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        stopping: str | None = None  # why every node is being stopped: "failure", "timeout", "cancel"
        stop_backstop = None
        try:
            while any(node.outcome is None for node in self._nodes):
                self._pump(ray)
                if stop_backstop is None and stopping is not None:
                    stop_backstop = time.monotonic() + _STOP_BACKSTOP_S
                if stop_backstop is not None and time.monotonic() > stop_backstop:
                    for node in self._live():  # its agent is killed on the way out
                        self._lose(node, TimeoutError(f"its node did not stop within {_STOP_BACKSTOP_S:g} s"))
                if self._stacks_requested:
                    self._stacks_requested = False
                    for node in self._live():
                        node.agent.request_stacks.remote()
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
            self._pump_until_ended(ray)
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

    # ------------------------------------------------------------------ the streams
    def _live(self) -> list[_Node]:
        return [node for node in self._nodes if node.outcome is None]

    def _pump(self, ray: Any) -> None:
        """Ask every live agent for its events; handle whatever arrives within ``_CHECK_S``."""
        for node in self._live():
            if node.pending is None:
                node.pending = node.agent.next_events.remote(_POLL_S)
        pending = {node.pending: node for node in self._live()}
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=_CHECK_S)
        if ready:  # and whatever else is ready by now, in one pass
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in ready:
            node = pending[ref]
            node.pending = None
            try:
                events, outcome = ray.get(ref)
            except ray.exceptions.RayActorError as error:  # the agent died: its node, or Ray lost it
                self._lose(node, error)
                continue
            except Exception as error:  # its events could not be read here (a value only its node can load)
                node.agent.cancel.remote("stop")
                self._lose(node, error, "its node's events could not be loaded here")
                continue
            for event in events:
                self._show(node, event)
            if outcome is not None:
                node.outcome = outcome

    def _pump_until_ended(self, ray: Any) -> None:
        end = time.monotonic() + _STOP_BACKSTOP_S
        while self._live() and time.monotonic() < end:
            try:
                self._pump(ray)
            except KeyboardInterrupt:
                continue  # a second interrupt while stopping: the stop is already under way
        for node in self._live():
            self._lose(node, TimeoutError(f"its agent did not stop within {_STOP_BACKSTOP_S:g} s"))

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

    def _lose(self, node: _Node, error: BaseException, what: str = "its node's nblaunch agent was lost") -> None:
        """The agent is gone (or unreadable): every rank of its node that had not finished
        failed with it. Its agent is killed when the launch's nodes are released."""
        reason = f"{what} ({_first_line(error)})"
        local = [r - node.first_rank for r in node.ranks if r not in node.finished]
        node.outcome = ("lost", [RankFailure(r, reason, phase=Phase.ENDED) for r in local])
        for r in local:
            self._show(node, RankFinished(rank=r, state=RankState.FAILED, detail=reason))

    def _stop_all(self, why: str) -> None:
        for node in self._live():
            if not node.asked_to_stop:
                node.asked_to_stop = True
                node.agent.cancel.remote(why)

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
            f"the results of node {node.index} could not be loaded here ({_first_line(error)}): return values this "
            "machine can load (plain Python values, CPU tensors)"
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
