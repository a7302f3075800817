"""A spawned rank's side of the payload (see ``nblaunch.launch.payload``): read it from the
control pipe and rebuild ``(function, args)``, mapping shared bytes privately (copy-on-write)."""

from __future__ import annotations

import io
import mmap
import os
import pickle
from typing import Any, Callable, NoReturn

from nblaunch import wire


def _map_private(fd: int, size: int) -> mmap.mmap:
    """The memfd ``fd`` the launcher passed down, mapped copy-on-write: writes here stay here."""
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class _PayloadUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, buffers: list[Any]):
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._storages: dict[int, Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        tag, fd, size, dtype = pid
        if tag != wire.SHARED_STORAGE:
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        import torch

        untyped = self._storages.get(fd)
        if untyped is None:
            # The tensor keeps the mapping alive (torch.frombuffer holds the buffer).
            untyped = torch.frombuffer(_map_private(fd, size), dtype=torch.uint8).untyped_storage()
            self._storages[fd] = untyped
        if dtype is None:
            return untyped
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def load(data: bytes, buffers: list[tuple[int, int]]) -> tuple[Callable, tuple]:
    """``(function, args)`` from a payload's pickle and its out-of-band buffers. The memfds are
    closed afterwards: the mappings keep their memory."""
    views = [memoryview(_map_private(fd, size)) for fd, size in buffers]
    unpickler = _PayloadUnpickler(data, views)
    try:
        return unpickler.load()
    finally:
        for fd in {fd for fd, _ in buffers} | set(unpickler._storages):
            try:
                os.close(fd)
            except OSError:
                pass


def read(control_fd: int) -> tuple[Any, bytes, list[tuple[int, int]], wire.FrameReader, list]:
    """``(settings, pickle, buffers, reader, later)`` from the control pipe; exits if the
    launcher is gone. ``reader`` and ``later`` (frames read past the payload, such as a warm
    rank's first call) are the watch thread's to go on with."""
    reader = wire.FrameReader()
    head: tuple | None = None
    while True:
        chunk = os.read(control_fd, 1 << 20)
        if not chunk:
            _launcher_gone()
        frames = reader.feed(chunk)
        for index, (kind, body) in enumerate(frames):
            if kind == wire.SPAWN_SETTINGS:
                head = pickle.loads(body)
            elif kind == wire.PAYLOAD and head is not None:
                settings, buffers = head
                return settings, body, buffers, reader, frames[index + 1:]


def _launcher_gone() -> NoReturn:
    os._exit(1)  # the launcher went away before sending the work
