"""The payload: the user's function and arguments for spawned ranks, and a warm rank's calls.

Under fork every rank gets its own copy-on-write view of the notebook's memory. Spawn gives the
same: big CPU tensor storages and out-of-band pickle buffers (numpy arrays) of at least
``_SHARE_MIN_BYTES`` are copied once into an anonymous memory file (memfd) instead of into the
pickle, and each rank maps that file *privately* (see ``nblaunch.worker.payload``): it reads the
same pages, and what it writes it writes to pages of its own. The memfds reach a spawned rank
as inherited descriptors and a warm rank's call over its control socket (SCM_RIGHTS), so
nothing depends on /proc/<launcher>/fd being openable. The notebook's objects are never
touched, and nothing is left in /dev/shm; the pages are freed with the last rank mapping them.
A warm call's arguments get the same copy semantics under fork too: the ranks were forked
before the arguments existed.

The launcher's peak memory is the objects plus one copy of their bytes (written with ``write``,
never mapped here), where pickling them whole would cost a copy per rank and per layer.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from nblaunch import wire
from nblaunch.launch.processes import fdtable

_SHARE_MIN_BYTES = 1 << 20
_SHARE_MAX_FILES = 256  # the launcher keeps one descriptor open per shared object


@dataclass
class Payload:
    """What a spawned rank receives: the pickle, and where its shared bytes are."""

    data: bytes
    buffers: list[tuple[int, int]] = field(default_factory=list)  # out-of-band buffers: (fd, size)
    fds: list[int] = field(default_factory=list)  # the memfds; fdtable.close() them at the launch's end


def _memfd_copy(view: memoryview) -> int:
    fd = fdtable.new_memfd("nblaunch-argument")
    try:
        wire.write_all(fd, view.cast("B"))
    except BaseException:
        fdtable.close([fd])
        raise
    return fd


class _SharingPickler(cloudpickle.Pickler):
    """cloudpickle (protocol 5), with big CPU tensor storages and big out-of-band buffers
    copied to memfds and replaced by references."""

    def __init__(self, file: io.BytesIO, payload: Payload):
        super().__init__(file, protocol=5, buffer_callback=self._buffer)
        self._torch = sys.modules.get("torch")
        self._payload = payload
        self._storage_fds: dict[tuple[int, int], int] = {}

    def _room(self, nbytes: int) -> bool:
        return nbytes >= _SHARE_MIN_BYTES and len(self._payload.fds) < _SHARE_MAX_FILES

    def _buffer(self, buffer: pickle.PickleBuffer) -> bool:
        """True: pickle this buffer in-band; False: it travels out of band, through a memfd."""
        view = buffer.raw()
        if not self._room(view.nbytes):
            return True
        fd = _memfd_copy(view)
        self._payload.fds.append(fd)
        self._payload.buffers.append((fd, view.nbytes))
        return False

    def persistent_id(self, obj: Any):
        torch = self._torch
        if torch is None:
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, None
        else:
            return None
        size = untyped.nbytes()
        if untyped.device.type != "cpu" or size == 0:
            return None
        # Every view of a tensor reduces to a storage object of its own: one memfd per memory,
        # so views of one tensor stay views of one tensor in the rank.
        key = (untyped.data_ptr(), size)
        fd = self._storage_fds.get(key)
        if fd is None:
            if not self._room(size):
                return None
            fd = _memfd_copy(memoryview((ctypes.c_char * size).from_address(untyped.data_ptr())))
            self._payload.fds.append(fd)
            self._storage_fds[key] = fd
        return (wire.SHARED_STORAGE, fd, size, dtype)


def package(value: Any) -> Payload:
    """``value`` pickled for a rank that does not share this process's memory, big bytes in
    memfds; ``fdtable.close(payload.fds)`` once every rank has them (or the launch is over).

    Example::

        payload = package((train, (big_tensor,)))
        len(payload.data)    # small: the tensor's bytes are in a memfd
    """
    payload = Payload(b"")
    if not hasattr(os, "memfd_create"):  # not Linux: everything in the pickle
        payload.data = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return payload
    out = io.BytesIO()
    try:
        _SharingPickler(out, payload).dump(value)
    except BaseException:
        fdtable.close(payload.fds)
        raise
    payload.data = out.getvalue()
    return payload
