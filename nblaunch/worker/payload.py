"""A rank's side of the payload (see ``nblaunch.launch.processes.packing``): read a spawned rank's from the
control socket and rebuild ``(function, args)``, or a warm rank's call, mapping shared bytes
privately (copy-on-write)."""

from __future__ import annotations

import io
import mmap
import os
import pickle
from typing import Any

from nblaunch import wire
from nblaunch.worker.control import ControlSocket


def _map_private(fd: int, size: int) -> mmap.mmap:
    """The memfd ``fd`` the launcher passed down, mapped copy-on-write: writes here stay here."""
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class _PayloadUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, buffers: list[Any], local_fd: dict[int, int]):
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._storages: dict[int, Any] = {}
        self._local_fd = local_fd

    def persistent_load(self, pid: Any) -> Any:
        tag, launcher_fd, size, dtype = pid
        if tag != wire.SHARED_STORAGE:
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        fd = self._local_fd.get(launcher_fd, launcher_fd)
        import torch

        untyped = self._storages.get(fd)
        if untyped is None:
            # The tensor keeps the mapping alive (torch.frombuffer holds the buffer).
            untyped = torch.frombuffer(_map_private(fd, size), dtype=torch.uint8).untyped_storage()
            self._storages[fd] = untyped
        if dtype is None:
            return untyped
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def load(data: bytes, buffers: list[tuple[int, int]], local_fd: dict[int, int] | None = None) -> Any:
    """The value a payload's pickle holds (a spawned rank's ``(function, args)``, a warm
    rank's call), given its out-of-band buffers. ``local_fd`` turns the launcher's memfd numbers
    into this process's, where they differ (memfds received over a socket); without it they are
    the same (inherited). The memfds are closed afterwards: the mappings keep their memory."""
    local_fd = local_fd or {}
    used = set(local_fd.values()) | {local_fd.get(fd, fd) for fd, _ in buffers}
    unpickler = None
    try:
        views = [memoryview(_map_private(local_fd.get(fd, fd), size)) for fd, size in buffers]
        unpickler = _PayloadUnpickler(data, views, local_fd)
        return unpickler.load()
    finally:
        for fd in used | (set(unpickler._storages) if unpickler is not None else set()):
            try:
                os.close(fd)
            except OSError:
                pass


def read(control: ControlSocket) -> tuple[Any, bytes, list[tuple[int, int]], dict[int, int]]:
    """``(settings, pickle, buffers, local_fd)`` from the control socket; exits if the launcher
    is gone. ``local_fd`` maps the launcher's memfd numbers to this process's where they came in
    a SHARED frame first (a rank forked by the launch server), and is empty where they were
    inherited (a spawned rank). Frames read past the payload (a warm rank's first call) stay in
    ``control`` for the watch thread."""
    head: tuple | None = None
    local_fd: dict[int, int] = {}
    while True:
        frames = control.next_frames()
        for index, (kind, body) in enumerate(frames):
            if kind == wire.SHARED and head is None:
                local_fd, _ = control.shared_memory(body)
            elif kind == wire.SPAWN_SETTINGS:
                head = pickle.loads(body)
            elif kind == wire.PAYLOAD and head is not None:
                control.put_back(frames[index + 1 :])
                settings, buffers = head
                return settings, body, buffers, local_fd
