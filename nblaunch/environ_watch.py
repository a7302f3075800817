"""What one thread's code reads from and writes into ``os.environ``, the writes put back: for
importing libraries in a process for the ranks it will fork, without changing what else runs in
it (``launch/starting/preload``).

Some imports write into ``os.environ`` (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR, torch_xla
sets XLA_FLAGS and more). Those variables are for the ranks, not the user's kernel. Some read
variables and keep their values from their import on. Only what the importing thread itself
read and wrote counts: the kernel's other threads (a cell that sets a variable meanwhile) are left
alone.
"""

from __future__ import annotations

import collections.abc
import contextlib
import os
import threading
from typing import Iterator


@contextlib.contextmanager
def watched_environ() -> Iterator["EnvironWatch"]:
    """While the body runs, what this thread reads from and writes into ``os.environ`` is noted;
    at its end, what it wrote is put back as it was (a variable it deleted comes back).

    Example::

        with watched_environ() as watch:
            import huggingface_hub.constants
        watch.read      # {"HF_HUB_OFFLINE", "HF_HOME", ...}: its values are kept from here on
        watch.written   # {} (what it set, for the ranks; os.environ is as before)
    """
    real = os.environ
    watch = EnvironWatch(real, threading.get_ident())
    os.environ = watch  # os.getenv reads the module's global: it is watched too
    try:
        yield watch
    finally:
        os.environ = real
        watch.stop()


class EnvironWatch(collections.abc.MutableMapping):
    """``os.environ`` as one thread sees it while watched (``watched_environ``). Other threads
    go through it unwatched; code that kept a reference to it (``from os import environ`` in an
    import) keeps a plain view of the real one once the watch is over."""

    def __init__(self, real: os._Environ, owner: int) -> None:
        self._real = real
        self._owner: int | None = owner
        self.read: set[str] = set()  # "*": something went through them all
        self.written: dict[str, str] = {}  # what the owner set (deleted ones are not here)
        self._before: dict[str, str | None] = {}  # each written variable's value before its first write

    def _mine(self) -> bool:
        return self._owner is not None and threading.get_ident() == self._owner

    def stop(self) -> None:
        """Put back what the owner wrote; watch no more."""
        for name, value in self._before.items():
            if value is None:
                self._real.pop(name, None)
            else:
                self._real[name] = value
        self._owner = None

    def __getitem__(self, name: str) -> str:
        if self._mine():
            self.read.add(name)
        return self._real[name]

    def get(self, name: str, default: object = None) -> object:
        if self._mine():
            self.read.add(name)
        return self._real.get(name, default)

    def __contains__(self, name: object) -> bool:
        if self._mine():
            self.read.add(str(name))
        return name in self._real

    def __setitem__(self, name: str, value: str) -> None:
        if self._mine():
            self._before.setdefault(name, self._real.get(name))
            self.written[name] = value
        self._real[name] = value

    def __delitem__(self, name: str) -> None:
        if self._mine():
            self._before.setdefault(name, self._real.get(name))
            self.written.pop(name, None)
        del self._real[name]

    def __iter__(self) -> Iterator[str]:
        if self._mine():
            self.read.add("*")
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)

    def copy(self) -> dict[str, str]:
        if self._mine():
            self.read.add("*")
        return self._real.copy()

    # Going through them all reads no variable by its name ("*"): a library that filters the
    # environment at import (torch's does) keeps no value of any one of them.
    def items(self):  # noqa: ANN201  os.environ's view
        if self._mine():
            self.read.add("*")
        return self._real.items()

    def values(self):  # noqa: ANN201  os.environ's view
        if self._mine():
            self.read.add("*")
        return self._real.values()

    def __getattr__(self, name: str) -> object:  # os._Environ's own (encodekey, ...)
        return getattr(self._real, name)
