"""``python -m nblaunch.cluster.socket_agent HOST PORT NODE_VARIABLE [HOST_VARIABLE]``: one
node's agent, started by an engine that only starts processes (Slurm's ``srun``, one task per node).

It connects to the driver's :class:`~nblaunch.cluster.node_socket.Hub` at ``HOST:PORT`` (or at
the address in the environment variable ``HOST_VARIABLE`` first: Slurm's
``SLURM_LAUNCH_NODE_IPADDR``, srun's host as the node reached it, is right where a host name
resolves to a loopback address), shows
the token it was given in ``NBLAUNCH_AGENT_TOKEN`` (an environment variable: a command line is
readable by every user of the node), says which node it is (the number in the environment
variable ``NODE_VARIABLE``, Slurm's ``SLURM_PROCID``), where it is and a port free there, then
runs that node's ranks with :class:`~nblaunch.cluster.agent.NodeAgent`, as a Ray node does, and
sends its events back. It ends when its launch has ended and said so, or when the driver's
connection ends (the kernel is gone): its ranks are then stopped first.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import traceback

from nblaunch.cluster.agent import NodeAgent
from nblaunch.cluster.node_socket import receive_frame, send_frame
from nblaunch.contract import variables as v
from nblaunch.contract.version import __version__
from nblaunch.launch.planning import ports

_CONNECT_S = 60.0  # the driver listens before the agents start: only a slow network takes this long
_STOP_S = 30.0  # a launch told to stop ends within a second or two; past this the agent just exits


def main(argv: list[str]) -> int:
    host, port, node_variable = argv[0], int(argv[1]), argv[2]
    token = os.environ.pop(v.AGENT_TOKEN, "")  # not for the ranks
    node = int(os.environ[node_variable])
    sock = _connect([os.environ.get(name, "") for name in argv[3:]] + [host], port)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # The address this node reached the driver from: one the other nodes can reach as well.
    address = sock.getsockname()[0]
    agent = NodeAgent()  # torch is imported in the background meanwhile
    sending = threading.Lock()

    def send(message: tuple) -> None:
        with sending:
            send_frame(sock, message)

    sock.sendall(token.encode())
    send(("hello", node, address, ports.choose_port(address, None, hosted_here=True), __version__))
    pump: threading.Thread | None = None
    stopped_by_slurm = threading.Event()

    def on_terminate(*_: object) -> None:  # Slurm's stop (time limit, preemption, scancel): as an interrupt
        if pump is None:
            os._exit(143)
        stopped_by_slurm.set()
        agent.cancel("stop")

    signal.signal(signal.SIGTERM, on_terminate)
    while True:
        try:
            message = receive_frame(sock)
        except (EOFError, OSError):
            break  # the driver is gone, or done with this node
        kind = message[0]
        if kind == "start":
            _, packed_request, place, driver_path, dropped = message
            try:
                _drop_variables(dropped)
                agent.start(packed_request, place, driver_path)
            except BaseException:  # noqa: BLE001  the driver says why this node never ran
                send(("news", [], ("stopped", f"node {node} could not start its ranks:\n{traceback.format_exc()}")))
                break
            pump = threading.Thread(target=_forward_news, args=(agent, send, stopped_by_slurm),
                                    name="nblaunch-agent-news")
            pump.start()
        elif kind == "cancel":
            agent.cancel(message[1])
        elif kind == "stacks":
            agent.request_stacks()
        elif kind == "send":
            agent.send(message[1], message[2])
    if pump is not None and pump.is_alive():  # the kernel went away mid-launch: stop the ranks first
        agent.cancel("stop")
        pump.join(_STOP_S)
    return 0


def _connect(hosts: list[str], port: int) -> socket.socket:
    """A connection to the driver at the first of ``hosts`` that answers."""
    error: OSError | None = None
    for host in dict.fromkeys(h for h in hosts if h):
        try:
            return socket.create_connection((host, port), timeout=_CONNECT_S)
        except OSError as failed:
            error = failed
    raise error or OSError("no address to reach the driver at")


def _forward_news(agent: NodeAgent, send, stopped_by_slurm: threading.Event) -> None:
    """Every event of the node's launch to the driver, then its outcome; then the agent may end."""
    while True:
        events, outcome = agent.next_events(0.2)
        if outcome is not None and stopped_by_slurm.is_set() and outcome[0] != "failed":
            outcome = ("stopped", "Slurm stopped the job step (SIGTERM): the job's time limit, a preemption or "
                                  "a scancel (`sacct -j JOB` says which)")
        if events or outcome is not None:
            try:
                send(("news", events, outcome))
            except OSError:
                return  # the driver is gone: the main loop stops the ranks
            except Exception as error:  # noqa: BLE001  a result too big or odd to send: say so instead
                send(("news", [], ("stopped", f"the node's results could not be sent ({type(error).__name__}: "
                                              f"{error})")))
                return
        if outcome is not None:
            return


def _drop_variables(prefixes_and_kept: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
    """What the engine told this task (its number, its step) is not the ranks' world: those
    variables go, before any rank is forked; the job's own stay."""
    prefixes, kept = prefixes_and_kept
    for name in [name for name in os.environ if name.startswith(prefixes) and name not in kept]:
        del os.environ[name]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
