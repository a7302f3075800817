"""A detached job's conversation with kernels: a Unix socket in Linux's abstract namespace
(no file to leave behind, no path-length limit), each message a length and a cloudpickled value.
Abstract sockets have no file permissions, so the job checks every caller's credentials and
talks only to its own user.

Example::

    server = listen(launch_id)                 # in the supervisor
    connection = accept(server)                # None for another user's process
    client = connect(launch_id)                # in a kernel
    send(client, ("run", blob)); receive(connection)
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import cloudpickle

__all__ = ["listen", "accept", "connect", "send", "receive", "ChannelClosed", "ChannelUnreadable"]

_HEADER = struct.Struct("<Q")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ChannelClosed(ConnectionError):
    """The other end went away."""


class ChannelUnreadable(ValueError):
    """A whole message came, but it cannot be unpickled here (a module this process lacks)."""


def _address(launch_id: str) -> str:
    return f"\0nblaunch-{os.getuid()}-{launch_id}"


def listen(launch_id: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(_address(launch_id))
    server.listen(4)
    return server


def accept(server: socket.socket) -> socket.socket | None:
    """The next caller, or None (its connection closed) when it is not this user's process."""
    connection, _ = server.accept()
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    _, uid, _ = _CREDENTIALS.unpack(credentials)
    if uid != os.getuid():
        connection.close()
        return None
    return connection


def connect(launch_id: str) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(_address(launch_id))
    except OSError:
        client.close()
        raise ChannelClosed(f"detached job {launch_id} is not listening (it has ended)") from None
    return client


def send(connection: socket.socket, message: Any) -> None:
    body = cloudpickle.dumps(message)
    try:
        connection.sendall(_HEADER.pack(len(body)) + body)
    except OSError as error:
        raise ChannelClosed(str(error)) from None


def receive(connection: socket.socket) -> Any:
    """The next message; ``TimeoutError`` past the connection's timeout (if it has one) before
    the message began."""
    (length,) = _HEADER.unpack(_exactly(connection, _HEADER.size))
    body = _exactly(connection, length)
    try:
        return cloudpickle.loads(body)
    except Exception as error:
        raise ChannelUnreadable(f"{type(error).__name__}: {error}") from None


def _exactly(connection: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        try:
            chunk = connection.recv(min(left, 1 << 20))
        except TimeoutError:
            if left == size:
                raise  # nothing of this message yet: the caller may wait on
            connection.settimeout(None)  # mid-message: the rest is on its way
            continue
        except OSError as error:
            raise ChannelClosed(str(error)) from None
        if not chunk:
            raise ChannelClosed("the other end closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
