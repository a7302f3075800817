"""Pickling that gives up past a size: whatever an exception or a local variable holds (a 400 MB
tensor, a model), the record that carries it must arrive, and quickly. A tensor on a GPU is
never pickled: rebuilding it would start CUDA in the process that reads the record.

Example::

    pickle_within(ValueError("boom"), 4 << 20)        # bytes
    pickle_within(torch.zeros(10**8), 4 << 20)         # None: too big, never copied whole
"""

from __future__ import annotations

import io
import pickle
import sys
import warnings
from typing import Any

import cloudpickle


class _TooBig(Exception):
    pass


class _BoundedBuffer(io.BytesIO):
    """Refuses to grow past ``limit``: a big bytes object or list is never copied whole, the
    pickler stops at its first write past it."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, data) -> int:
        if self.tell() + memoryview(data).nbytes > self.limit:
            raise _TooBig
        return super().write(data)


class _BoundedPickler(cloudpickle.Pickler):
    """Gives up before serialising a big tensor or array at all (their bytes would be made in
    memory first, then written). By value, as cloudpickle does: a class from a notebook cell
    is rebuilt on the other side."""

    def __init__(self, out: _BoundedBuffer) -> None:
        super().__init__(out, protocol=pickle.HIGHEST_PROTOCOL)
        self.limit = out.limit

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, io.IOBase):  # cloudpickle would read an open file whole, a 10 GB log too
            raise _TooBig
        torch = sys.modules.get("torch")  # a tensor on a GPU would start CUDA where it is rebuilt
        if torch is not None and isinstance(obj, (torch.Tensor, torch.UntypedStorage)) and obj.device.type != "cpu":
            raise _TooBig
        nbytes = getattr(obj, "nbytes", None)  # numpy arrays, torch tensors and storages
        if callable(nbytes):
            nbytes = nbytes()
        if isinstance(nbytes, int) and nbytes > self.limit:
            raise _TooBig
        return super().reducer_override(obj)


def pickle_within(obj: Any, limit: int) -> bytes | None:
    """``obj`` pickled, if it fits in ``limit`` bytes and can be rebuilt; else None. Pickling
    runs the object's own code: whatever that raises, this returns."""
    out = _BoundedBuffer(limit)
    try:
        with warnings.catch_warnings():  # torch's TypedStorage deprecation, as its size is read
            warnings.simplefilter("ignore")
            _BoundedPickler(out).dump(obj)
        pickled = out.getvalue()
        pickle.loads(pickled)  # what pickles but cannot be rebuilt is no use
        return pickled
    except BaseException:
        return None
