"""The driver's end of a socket to each node's agent, for clusters whose engine only starts
processes (Slurm's ``srun``), where Ray carries calls for ``RayCluster``.

The driver listens (:class:`Hub`); every agent (``cluster/socket_agent``) connects, shows the
launch's token, and says where it is. From then on both sides send frames: a 4-byte length and
a pickled tuple. Agent to driver: ``("hello", node, address, free_port, version)``,
``("news", events, outcome)``. Driver to agent: ``("start", request, place, sys_path)``,
``("cancel", why)``, ``("stacks",)``, ``("send", kind, body)``. Nothing is unpickled before the
token has been checked: a process that is not the launch's agent is dropped unread.

Example (what ``SlurmCluster.attempt`` does)::

    with Hub(token) as hub:                   # listening on every interface, a free port
        ...                                   # srun starts one agent per node, told hub.port
        while not hub.accept_for(2, 0.2):     # until both nodes' agents have said hello
            ...                               # (meanwhile: cancelled? timed out? srun ended?)
        links = SocketLinks(hub.in_order())   # the watcher's NodeLinks
"""

from __future__ import annotations

import hmac
import pickle
import queue
import select
import socket
import struct
import threading

import cloudpickle

from nblaunch.cluster.watcher import NodeNews

_LENGTH = struct.Struct("!Q")  # a node's results may pass 4 GiB
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
    """The driver's listening socket; :meth:`accept_for` collects one connection per node, each
    greeted on a thread of its own (a silent connection holds up nobody)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._listener = socket.create_server(("", 0), family=socket.AF_INET, backlog=128)
        self.port = self._listener.getsockname()[1]
        self.agents: dict[int, AgentConnection] = {}  # by node, as they said hello
        self._greeted: queue.Queue[AgentConnection] = queue.Queue()

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def accept_for(self, num_nodes: int, seconds: float) -> bool:
        """Take the connections that arrive within ``seconds``; True once nodes 0..num_nodes-1
        have all said hello."""
        ready, _, _ = select.select([self._listener], [], [], seconds)
        if ready:
            sock, _ = self._listener.accept()
            threading.Thread(target=self._greet, args=(sock,), name="nblaunch-hub-greeting", daemon=True).start()
        while not self._greeted.empty():
            connection = self._greeted.get()
            if 0 <= connection.node < num_nodes and connection.node not in self.agents:
                self.agents[connection.node] = connection
            else:
                connection.close()  # not one of this launch's nodes, or a node twice
        return len(self.agents) == num_nodes

    def in_order(self) -> list[AgentConnection]:
        return [self.agents[node] for node in sorted(self.agents)]

    def _greet(self, sock: socket.socket) -> None:
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
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._greeted.put(AgentConnection(sock, hello))

    def close(self) -> None:
        """Every agent sees its connection end (and stops its ranks); no new one is taken."""
        self._listener.close()
        while not self._greeted.empty():
            self._greeted.get().close()
        for agent in self.agents.values():
            agent.close()


class SocketLinks:
    """``cluster/watcher.NodeLinks`` over the agents' sockets: a thread per agent reads its
    frames into one queue, which ``poll`` empties."""

    def __init__(self, agents: list[AgentConnection], where_to_look: str = "") -> None:
        self._agents = agents
        self._where_to_look = where_to_look  # said with a lost agent: where its last words are
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
                                                f"{error}){self._where_to_look}"))

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

