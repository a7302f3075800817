"""Importing heavy modules once in the launcher, so forked ranks inherit them.

Some imports write into ``os.environ`` (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR, torch_xla
sets XLA_FLAGS and more). Those variables are for the ranks, not the user's kernel: the kernel's
environment is put back and the changes are returned, for the launch to hand to its ranks.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import importlib
import os
from typing import Iterator


@functools.lru_cache(maxsize=None)
def import_for_ranks(module: str) -> dict[str, str]:
    """Import ``module`` here (once per kernel); return what the import wrote into os.environ.

    Example::

        extra_environ = import_for_ranks("torch._dynamo")  # {"TORCHINDUCTOR_CACHE_DIR": ...}
    """
    with environ_put_back() as changed:
        importlib.import_module(module)
    return changed


@contextlib.contextmanager
def environ_put_back() -> Iterator[dict[str, str]]:
    """Whatever the body writes into ``os.environ`` is undone at its end and left in the dict
    it yields (a variable the body deleted is put back, and not in the dict).

    Example::

        with environ_put_back() as changed:
            import torch._dynamo
        changed   # {"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_me"}; os.environ as before
    """
    before = dict(os.environ)
    changed: dict[str, str] = {}
    try:
        yield changed
    finally:
        after = dict(os.environ)
        changed.update({name: value for name, value in after.items() if before.get(name) != value})
        # Only what the body touched is put back: other threads read os.environ meanwhile.
        for name in changed:
            if name in before:
                os.environ[name] = before[name]
            else:
                del os.environ[name]
        for name in before.keys() - after.keys():
            os.environ[name] = before[name]


@contextlib.contextmanager
def environ_reads() -> Iterator[set[str]]:
    """The names of the variables read from ``os.environ`` by Python code while the body runs
    (by any thread: more is safe), in the set it yields; ``"*"`` if something read them all.
    C code's ``getenv`` is not seen.

    Example::

        with environ_reads() as read:
            import huggingface_hub
        "HF_HUB_OFFLINE" in read   # True: its value is kept from the import on
    """
    real = os.environ
    recording = _RecordingEnviron(real)
    os.environ = recording  # os.getenv reads the module's global: it records too
    try:
        yield recording.read
    finally:
        os.environ = real


class _RecordingEnviron(collections.abc.MutableMapping):
    def __init__(self, real: os._Environ) -> None:
        self._real = real
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.read.add(name)
        return self._real[name]

    def get(self, name: str, default: object = None) -> object:
        self.read.add(name)
        return self._real.get(name, default)

    def __contains__(self, name: object) -> bool:
        self.read.add(str(name))
        return name in self._real

    def __setitem__(self, name: str, value: str) -> None:
        self._real[name] = value

    def __delitem__(self, name: str) -> None:
        del self._real[name]

    def __iter__(self) -> Iterator[str]:
        self.read.add("*")
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)

    def copy(self) -> dict[str, str]:
        self.read.add("*")
        return self._real.copy()

    def __getattr__(self, name: str) -> object:  # os._Environ's own (encodekey, ...)
        return getattr(self._real, name)
