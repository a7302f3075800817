"""The driver's end of a socket to each node's agent, for homes whose engine only starts
processes (Slurm's ``srun``), where Ray carries calls for the Ray home.

The driver listens (:class:`Hub`); every agent (``cluster/socket_agent``) connects, shows the
launch's token, and says where it is. From then on both sides send frames: a 4-byte length and
a pickled tuple. Agent to driver: ``("hello", node, address, free_port, version)``,
``("news", events, outcome)``. Driver to agent: ``("start", request, place, sys_path)``,
``("cancel", why)``, ``("stacks",)``, ``("send", kind, body)``. Nothing is unpickled before the
token has been checked: a process that is not the launch's agent is dropped unread.

Example (what ``SlurmHome.attempt`` does)::

    with Hub(token) as hub:                   # listening on every interface, a free port
        ...                                   # srun starts one agent per node, told hub.port
        hellos = hub.accept(2, still_starting)  # every agent connected, in node order
        links = SocketLinks(hub.agents)       # the watcher's NodeLinks
"""

from __future__ import annotations

import hmac
import pickle
import queue
import select
import socket
import struct
import threading
import time
from typing import Callable

import cloudpickle

from nblaunch.cluster.watcher import NodeNews
from nblaunch.launch.errors import LaunchConfigError

_LENGTH = struct.Struct("!I")
TOKEN_BYTES = 32  # hex characters of the token an agent sends first


def send_frame(sock: socket.socket, message: tuple) -> None:
    data = cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive_frame(sock: socket.socket) -> tuple:
    """The next frame; ``EOFError`` when the other end has closed."""
    (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    return pickle.loads(_exactly(sock, length))


def _exactly(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class AgentConnection:
    """One agent's socket, as the driver holds it: frames out under a lock (any thread)."""

    def __init__(self, sock: socket.socket, hello: tuple) -> None:
        self.sock = sock
        _, self.node, self.address, self.free_port, self.version = hello
        self._sending = threading.Lock()

    def send(self, message: tuple) -> bool:
        """False when the agent is gone (its loss is the reader's to report)."""
        try:
            with self._sending:
                send_frame(self.sock, message)
            return True
        except OSError:
            return False

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Hub:
    """The driver's listening socket; ``accept`` collects one connection per node."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._listener = socket.create_server(("", 0), family=socket.AF_INET, backlog=128)
        self.port = self._listener.getsockname()[1]
        self.agents: list[AgentConnection] = []

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def accept(self, num_nodes: int, still_starting: Callable[[], str | None], deadline: float) -> list[AgentConnection]:
        """Wait until the agents of nodes 0..num_nodes-1 have connected and said hello; they are
        then in ``self.agents`` in node order. ``still_starting()`` returns why the agents will
        never come (their step ended), else None; past ``deadline`` (monotonic) the wait fails."""
        by_node: dict[int, AgentConnection] = {}
        while len(by_node) < num_nodes:
            why_not = still_starting()
            if why_not is not None:
                raise LaunchConfigError(why_not)
            if time.monotonic() > deadline:
                raise LaunchConfigError(
                    f"only {len(by_node)} of {num_nodes} nodes' nblaunch agents reached this kernel (port "
                    f"{self.port}) in time: can the nodes connect to this machine? (a firewall between compute "
                    "and login nodes blocks it; run the notebook inside the allocation instead)")
            ready, _, _ = select.select([self._listener], [], [], 0.2)
            if not ready:
                continue
            sock, _ = self._listener.accept()
            connection = self._greet(sock)
            if connection is not None and 0 <= connection.node < num_nodes:
                by_node[connection.node] = connection
        self.agents = [by_node[index] for index in range(num_nodes)]
        return self.agents

    def _greet(self, sock: socket.socket) -> AgentConnection | None:
        """The agent's token, then its hello; anything else is closed unread."""
        sock.settimeout(10.0)  # a connection that says nothing is not an agent
        try:
            token = _exactly(sock, TOKEN_BYTES)
            if not hmac.compare_digest(token, self._token):
                raise ValueError("wrong token")
            hello = receive_frame(sock)
            if hello[0] != "hello":
                raise ValueError("no hello")
        except (OSError, EOFError, ValueError, pickle.UnpicklingError, struct.error):
            sock.close()
            return None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return AgentConnection(sock, hello)

    def close(self) -> None:
        """Every agent sees its connection end (and stops its ranks); no new one is taken."""
        self._listener.close()
        for agent in self.agents:
            agent.close()


class SocketLinks:
    """``cluster/watcher.NodeLinks`` over the agents' sockets: a thread per agent reads its
    frames into one queue, which ``poll`` empties."""

    def __init__(self, agents: list[AgentConnection]) -> None:
        self._agents = agents
        self._news: queue.Queue[NodeNews] = queue.Queue()
        for index, agent in enumerate(agents):
            threading.Thread(target=self._read, args=(index, agent), name=f"nblaunch-node{index}-reader",
                             daemon=True).start()

    def _read(self, index: int, agent: AgentConnection) -> None:
        try:
            while True:
                _, events, outcome = receive_frame(agent.sock)
                self._news.put(NodeNews(index, events, outcome))
                if outcome is not None:
                    return
        except Exception as error:  # noqa: BLE001  closed, reset, or a frame this process cannot load
            what = "lost" if isinstance(error, (EOFError, OSError)) else "unreadable here"
            self._news.put(NodeNews(index, lost=f"its node's nblaunch agent was {what} ({type(error).__name__}: "
                                                f"{error})"))

    def poll(self, live: list[int], timeout: float) -> list[NodeNews]:
        news: list[NodeNews] = []
        try:
            news.append(self._news.get(timeout=timeout))
            while True:
                news.append(self._news.get_nowait())
        except queue.Empty:
            pass
        return news

    def cancel(self, index: int, why: str) -> None:
        self._agents[index].send(("cancel", why))

    def request_stacks(self, index: int) -> None:
        self._agents[index].send(("stacks",))

    def send(self, index: int, kind: bytes, body: bytes) -> None:
        self._agents[index].send(("send", kind, body))

