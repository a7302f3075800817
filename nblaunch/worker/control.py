"""The rank's end of its control socket: frames from the launcher, and the memfds they bring.

The launcher writes the spawn payload, stack requests and a warm rank's calls here. A call's big
tensors come as memfds carried by the header of a ``SHARED`` frame (SCM_RIGHTS); they must be
read with ``recvmsg``, never ``read``, which would drop them. Both readers of the socket (the
spawn payload's loader, then the watch thread) go through one :class:`ControlSocket`, so no
frame or descriptor read by the first is lost to the second.

Example::

    control = ControlSocket(fd)
    for kind, body in control.next_frames():   # blocks; [] never, EOF exits the rank
        ...
"""

from __future__ import annotations

import collections
import os
import pickle
import socket
from typing import NoReturn

from nblaunch import wire

_MAX_FDS_PER_READ = 253  # the kernel's limit per message (SCM_MAX_FD)


class ControlSocket:
    """Frames, in order, from the launcher; the descriptors that came with them, in order."""

    def __init__(self, fd: int) -> None:
        self._socket = socket.socket(fileno=fd)  # never closed: the rank leaves with os._exit
        self._reader = wire.FrameReader()
        self._received: collections.deque[int] = collections.deque()
        self._unhandled: list[tuple[bytes, bytes]] = []  # read, not yet handed out

    def next_frames(self) -> list[tuple[bytes, bytes]]:
        """The next whole frames (at least one); exits the rank if the launcher is gone."""
        while not self._unhandled:
            try:
                chunk, fds, _, _ = socket.recv_fds(self._socket, 1 << 16, _MAX_FDS_PER_READ)
            except OSError:
                chunk, fds = b"", []
            if not chunk:
                _launcher_gone()
            self._received.extend(fds)
            self._unhandled = self._reader.feed(chunk)
        frames, self._unhandled = self._unhandled, []
        return frames

    def put_back(self, frames: list[tuple[bytes, bytes]]) -> None:
        """Frames read but not for this reader (a warm rank's first call, read with the payload)."""
        self._unhandled = list(frames) + self._unhandled

    def shared_memory(self, body: bytes) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """A SHARED frame's ``({launcher's fd number: ours}, out-of-band buffers)``. Its memfds
        rode on its own header, so by the time the frame is whole they are all here."""
        launcher_fds, buffers = pickle.loads(body)
        if len(self._received) < len(launcher_fds):
            raise RuntimeError(f"{len(launcher_fds)} memfds announced, {len(self._received)} received")
        return {fd: self._received.popleft() for fd in launcher_fds}, buffers


def _launcher_gone() -> NoReturn:
    os._exit(1)  # on Linux PR_SET_PDEATHSIG has usually acted first
