"""The way from a Ray launch's driver to its agents (``cluster/watcher.NodeLinks``): each
agent is an actor, long-polled for its events; every node's long-poll is in flight at once and
``ray.wait`` hands back whichever answers first."""

from __future__ import annotations

from typing import Any

from nblaunch.cluster.watcher import NodeNews, first_line

_POLL_S = 0.2  # how long an agent holds a long-poll open when nothing happens


class RayLinks:
    """The agents (Ray actor handles) of a launch's nodes, node k at ``agents[k]``."""

    def __init__(self, ray: Any, agents: list[Any]) -> None:
        self._ray = ray
        self._agents = agents
        self._pending: dict[int, Any] = {}  # node -> its next_events call in flight

    def poll(self, live: list[int], timeout: float) -> list[NodeNews]:
        ray = self._ray
        for index in live:
            if index not in self._pending:
                self._pending[index] = self._agents[index].next_events.remote(_POLL_S)
        waiting = {self._pending[index]: index for index in live}
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=timeout)
        if ready:  # and whatever else is ready by now, in one pass
            ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        news = []
        for ref in ready:
            index = waiting[ref]
            del self._pending[index]
            try:
                events, outcome = ray.get(ref)
            except ray.exceptions.RayActorError as error:  # the agent died: its node, or Ray lost it
                news.append(NodeNews(index, lost=f"its node's nblaunch agent was lost ({first_line(error)})"))
                continue
            except Exception as error:  # its events could not be read here (a value only its node can load)
                self.cancel(index, "stop")
                news.append(NodeNews(index, lost=f"its node's events could not be loaded here ({first_line(error)})"))
                continue
            news.append(NodeNews(index, events, outcome))
        return news

    def cancel(self, index: int, why: str) -> None:
        self._agents[index].cancel.remote(why)

    def request_stacks(self, index: int) -> None:
        self._agents[index].request_stacks.remote()

    def send(self, index: int, kind: bytes, body: bytes) -> None:
        self._agents[index].send.remote(kind, body)
